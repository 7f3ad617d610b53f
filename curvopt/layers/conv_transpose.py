"""Transposed convolutions ``nn.ConvTranspose{1,2,3}d``: the adjoint of a convolution with the
same hyper-parameters, so the roles swap: ``g_n(W) = x_n unfold(G_n)^T`` with ``x_n``
``[C_in, L]`` and ``unfold(G_n)`` ``[C_out k, L]`` (first order; the rest is ``conv``'s).
"""

from __future__ import annotations

import math

from torch import nn

from curvopt.errors import kronecker_error
from curvopt.layers.conv import ConvRuleBase
from curvopt.layers.registry import register
from curvopt.layers.unfold import unfold


@register(nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
class ConvTransposeRule(ConvRuleBase):
    def check(self, module):
        if module.padding_mode != "zeros":
            return (
                f"padding_mode={module.padding_mode!r} is not supported for transposed "
                "convolutions. Use padding_mode='zeros'."
            )
        return None

    def kron_output_factor(self, call, columns, name, approx, n):
        """None for the bias (its exact block); the weight has no Kronecker factors."""
        if name == "bias":
            return None
        raise kronecker_error(call.module, "its weight", "transposed convolutions have none")

    def _length(self, call):
        return call.input[0, 0].numel()

    def _operands(self, call):
        module, x, g = call.module, call.input, call.grad_out
        n = g.shape[0]
        patches = unfold(g, module.kernel_size, module.dilation, module.padding, module.stride)
        in_size = x.shape[2:]
        if patches.shape[-1] != math.prod(in_size):
            # output_padding >= stride adds trailing patch positions no input location maps to
            grid = patches.shape[-1]
            out_grid = [
                (o + 2 * p - d * (k - 1) - 1) // s + 1
                for o, p, d, k, s in zip(
                    g.shape[2:], module.padding, module.dilation, module.kernel_size, module.stride
                )
            ]
            assert math.prod(out_grid) == grid
            patches = patches.reshape(n, -1, *out_grid)
            patches = patches[(slice(None), slice(None)) + tuple(slice(0, s) for s in in_size)]
            patches = patches.reshape(n, patches.shape[1], -1)
        return x.reshape(x.shape[0], x.shape[1], -1), patches
