"""Rule for ``torch.nn.MSELoss``.

``loss = s * sum_i (x_i - y_i)^2`` with ``s = 1`` ("sum") or ``1 / numel`` ("mean"), so
``H_n = 2 s I``. Exact factor: ``sqrt(2 s) e_k`` for each of the ``P`` elements of a sample.
MC: the Gaussian predictive ``y ~ N(x, I / (2 s))`` gives loss gradients ``2 s (x - y)`` with
covariance ``2 s I``; the column ``sqrt(2 s / M) z``, ``z ~ N(0, I)``, has the same law.
"""

import math

import torch
from torch import nn

from curvopt.losses.base import DiagonalLossRule, reduction_scale, register_loss_rule


@register_loss_rule(nn.MSELoss)
class MSELossRule(DiagonalLossRule):
    def _check_target(self, loss_module, output, target):
        if target.shape != output.shape:
            raise ValueError(
                f"MSELoss: target shape {tuple(target.shape)} differs from input shape "
                f"{tuple(output.shape)}; broadcasting changes the loss, pass a target of the "
                f"input's shape."
            )

    def _sqrt_diagonal(self, loss_module, output, target):
        scale = reduction_scale(loss_module, output.numel())
        return torch.full_like(output, math.sqrt(2 * scale))

    def _sqrt_hessian_mc(self, loss_module, output, target, mc_samples, divisor):
        scale = reduction_scale(loss_module, output.numel())
        z = torch.randn(mc_samples, *output.shape, dtype=output.dtype, device=output.device)
        return math.sqrt(2 * scale / mc_samples) * z
