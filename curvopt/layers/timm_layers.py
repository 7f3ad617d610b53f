"""timm's layers, registered by qualified class name (timm is never imported).

timm subclasses torch's layers; the registry gives a subclass that defines its own ``forward``
its parent's rule only where it is registered for it (``registry.rule_for``). Registered here:

* ``timm.layers.linear.Linear``, ``timm.layers.norm.LayerNorm``: their ``forward`` computes
  their parent's function (``F.linear``; ``F.layer_norm``, or timm's fast variant of it), so
  they get ``nn.Linear``'s and ``nn.LayerNorm``'s rules.
* ``timm.layers.norm.LayerNorm2d`` (ConvNeXt): ``nn.LayerNorm`` over the channels of an NCHW
  input, ``y = x_hat * w + b`` with ``x_hat`` normalised along dim 1 at every position:
  ``g_n(w) = sum_{h,w} g_n * x_hat_n``, ``g_n(b) = sum_{h,w} g_n`` (:class:`LayerNorm2dRule`).
* ``timm.layers.norm_act.BatchNormAct2d`` (MobileNetV3, EfficientNet): ``y = act(drop(z))``
  with ``z = x_hat * w + b`` the ``nn.BatchNorm2d`` output and ``act`` elementwise; with
  ``g_z = act'(z) * g`` (the gradient at ``z``) the per-sample gradients are BatchNorm's
  (:class:`BatchNormAct2dRule`): in eval mode exact, in training mode (batch statistics) each
  sample's term of the batch gradient, for the coupled curvature as BatchNorm's.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from curvopt.layers.linear import LinearRule
from curvopt.layers.norm import BatchNormRule, LayerNormRule, _AffineNormRule
from curvopt.layers.registry import register_name

register_name("timm.layers.linear.Linear")(LinearRule)
register_name("timm.layers.norm.LayerNorm")(LayerNormRule)


@register_name("timm.layers.norm.LayerNorm2d")
class LayerNorm2dRule(_AffineNormRule):
    def check(self, module):
        if len(module.normalized_shape) != 1:
            return (
                f"it normalises over {tuple(module.normalized_shape)}, not one channel dim. "
                "Use normalized_shape of one dim (timm's LayerNorm2d(num_channels))."
            )
        return None

    def normalized(self, module, x):
        """``x_hat [N, C, H, W]``: each position's channels normalised."""
        return F.layer_norm(
            x.movedim(1, -1), module.normalized_shape, None, None, module.eps
        ).movedim(-1, 1)


#: torch's activations that act on each entry alone (``BatchNormAct2d``'s ``act``)
_ELEMENTWISE = (
    nn.Identity,
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.ELU,
    nn.CELU,
    nn.SELU,
    nn.GELU,
    nn.SiLU,
    nn.Mish,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.Hardtanh,
    nn.Sigmoid,
    nn.Tanh,
    nn.Softplus,
)

#: timm's own elementwise activations (``timm.layers.activations``, ``activations_me``)
_TIMM_ELEMENTWISE = {
    f"timm.layers.{module}.{name}"
    for module, names in (
        ("activations", ("Swish", "Mish", "Sigmoid", "Tanh", "HardSwish", "HardSigmoid")),
        ("activations", ("HardMish", "GELU", "GELUTanh", "QuickGELU")),
        ("activations_me", ("SwishMe", "MishMe", "HardSigmoidMe", "HardSwishMe", "HardMishMe")),
    )
    for name in names
}


def _qualified(module: nn.Module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


def _elementwise(act: nn.Module) -> bool:
    return type(act) in _ELEMENTWISE or _qualified(act) in _TIMM_ELEMENTWISE


@register_name("timm.layers.norm_act.BatchNormAct2d")
class BatchNormAct2dRule(BatchNormRule):
    curvature_free = False  # the activation is curved

    def check(self, module):
        act, drop = getattr(module, "act", nn.Identity()), getattr(module, "drop", nn.Identity())
        if not _elementwise(act):
            return (
                f"its activation {type(act).__name__} is not one curvopt knows to act on each "
                "entry alone. Use an activation of torch.nn (ReLU, SiLU, Hardswish, ...) or "
                "register a rule for the layer with curvopt.layers.register."
            )
        if not isinstance(drop, nn.Identity) and drop.training:
            return (
                f"its drop layer {type(drop).__name__} draws random numbers in training mode, "
                "which this rule does not replay. Call .eval() on it or build the layer "
                "without drop_layer."
            )
        return super().check(module)

    def batch_grad(self, call, name, out=None):
        at_z = dataclasses.replace(call, grad_out=self._pre_activation_grad(call), cache={})
        return super().batch_grad(at_z, name, out)

    def _pre_activation_grad(self, call) -> torch.Tensor:
        """``g_z = act'(z) * g``: the output gradient taken back through the activation to the
        BatchNorm output ``z = x_hat * w + b`` (``[N, C, H, W]``, ``w``, ``b`` along dim 1)."""
        module = call.module
        z = self.normalized(module, call.input.detach())
        if module.weight is not None:
            z = z * module.weight.detach().view(-1, 1, 1) + module.bias.detach().view(-1, 1, 1)
        with call.quiet(), torch.enable_grad():
            z = z.requires_grad_()
            (g_z,) = torch.autograd.grad(module.act(z.clone()), z, call.grad_out)
        return g_z
