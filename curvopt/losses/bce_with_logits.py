"""Rule for ``torch.nn.BCEWithLogitsLoss``.

Per element, ``l = -w [q y log sig(x) + (1 - y) log(1 - sig(x))]`` (``w = weight``,
``q = pos_weight``, both broadcast to the input; 1 when absent), summed times ``s = 1``
("sum") or ``1 / numel`` ("mean"). The Hessian is diagonal with

    d^2 l / dx^2 = w v sig (1 - sig),   v = 1 + (q - 1) y   (v = 1 without pos_weight).

Exact: ``r = sqrt(s w v sig (1 - sig))``. MC: ``sqrt(s w v / M) (y' - sig)`` with
``y' ~ Bernoulli(sig)`` independently per element; ``E[(y' - sig)^2] = sig (1 - sig)``. With
``pos_weight`` the Hessian depends on the observed ``y`` through ``v``, which rescales the samples.
"""

import torch
from torch import nn

from curvopt.errors import UnsupportedLossError
from curvopt.losses.base import DiagonalLossRule, reduction_scale, register_loss_rule


@register_loss_rule(nn.BCEWithLogitsLoss)
class BCEWithLogitsLossRule(DiagonalLossRule):
    def check_options(self, loss_module):
        super().check_options(loss_module)
        for option in ("weight", "pos_weight"):
            value = getattr(loss_module, option)
            if value is not None and (value < 0).any():
                raise UnsupportedLossError(
                    f"BCEWithLogitsLoss with a negative {option} has a Hessian that is not "
                    f"positive semi-definite, so it has no square root; use a nonnegative {option}."
                )

    def _check_target(self, loss_module, output, target):
        if target.shape != output.shape:
            raise ValueError(
                f"BCEWithLogitsLoss: target shape {tuple(target.shape)} differs from input shape "
                f"{tuple(output.shape)}; pass a target of the input's shape."
            )
        for option in ("weight", "pos_weight"):
            value = getattr(loss_module, option)
            if value is not None and _broadcast_shape(value.shape, output.shape) != output.shape:
                raise ValueError(
                    f"BCEWithLogitsLoss: {option} of shape {tuple(value.shape)} does not "
                    f"broadcast to the input shape {tuple(output.shape)}."
                )
        if loss_module.pos_weight is not None and ((target < 0) | (target > 1)).any():
            raise ValueError(
                "BCEWithLogitsLoss with pos_weight: targets must lie in [0, 1] (the Hessian "
                "depends on them and is not positive semi-definite otherwise)."
            )

    def _sqrt_diagonal(self, loss_module, output, target):
        variance = torch.sigmoid(output) * torch.sigmoid(-output)
        return (self._sample_scale(loss_module, output, target) * variance).sqrt()

    def _sqrt_hessian_mc(self, loss_module, output, target, mc_samples, divisor):
        prob = torch.sigmoid(output)
        sampled = torch.bernoulli(prob.expand(mc_samples, *output.shape))
        scale = self._sample_scale(loss_module, output, target) / mc_samples
        return scale.sqrt() * (sampled - prob)

    @staticmethod
    def _sample_scale(loss_module, output, target):
        """``s w v`` broadcast to ``output``'s shape (see module doc)."""
        scale = torch.full_like(output, reduction_scale(loss_module, output.numel()))
        if loss_module.weight is not None:
            scale = scale * loss_module.weight.to(output)
        if loss_module.pos_weight is not None:
            scale = scale * (1 + (loss_module.pos_weight.to(output) - 1) * target.to(output))
        return scale


def _broadcast_shape(*shapes):
    """The broadcast shape, or None when the shapes do not broadcast."""
    try:
        return torch.broadcast_shapes(*shapes)
    except RuntimeError:
        return None
