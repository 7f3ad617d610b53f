"""Hugging Face's ``Conv1D`` (GPT-2, GPT-J's ancestors): a linear layer with a transposed weight.

``x [N, *, I] -> y = x W + b  [N, *, O]`` with ``W [I, O]`` (``nx = I``, ``nf = O``). Every
quantity is that of ``nn.Linear`` with ``Wᵀ``, so the rule reuses :class:`LinearRule` and
transposes the weight's results: ``g_n(W) = sum_t x_nt g_ntᵀ`` ``[N, I, O]``.

Kronecker factors: ``vec(W)`` (row-major, input index first) pairs with ``kron(A, B)``, so the
list is ``[A (I x I), B (O x O)]``: input side first, unlike ``nn.Linear``'s ``[B, A]``; the
factors themselves are those of the equivalent ``nn.Linear``. ``DiagHessian`` takes it as a
layer linear in its input, with the weighted squares of ``nn.Linear`` transposed
(``sum_nt r_nto x_nti²`` indexed ``[i, o]``); ``KFRA`` does not handle it (it rejects the model).

The class is matched by name (curvopt does not import ``transformers``); :meth:`check`
verifies the layout (``weight [nx, nf]``, ``bias [nf]``) before any number is computed.
"""

from __future__ import annotations

import torch

from curvopt.layers.eigenbasis import eigen_moment
from curvopt.layers.linear import LinearRule, _flat, _projected
from curvopt.layers.registry import register_name


@register_name("Conv1D")
class TransposedLinearRule(LinearRule):
    def check(self, module):
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        nf = getattr(module, "nf", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != nf:
            return (
                "a module named Conv1D is handled as Hugging Face's transposed linear layer "
                "(weight [nx, nf], y = x @ weight + bias), but this one has no such weight; "
                "rename the class or register a rule for it with curvopt.layers.register"
            )
        if bias is not None and tuple(bias.shape) != (nf,):
            return f"its bias has shape {tuple(bias.shape)}, expected [nf] = [{nf}]"
        return None

    def batch_grad(self, call, name, out=None):
        if name == "bias":
            return super().batch_grad(call, name, out)
        x, g = call.input, call.grad_out
        n = g.shape[0]
        x, g = x.reshape(n, -1, x.shape[-1]), g.reshape(n, -1, g.shape[-1])
        if x.shape[1] == 1:
            return torch.mul(x.transpose(1, 2), g, out=out)
        return torch.bmm(x.transpose(1, 2), g, out=out)

    def sum_grad_squared(self, call, name):
        result = super().sum_grad_squared(call, name)
        return result if result is None or name == "bias" else result.T

    def column_grads(self, call, columns, name):
        result = super().column_grads(call, columns, name)
        return result if name == "bias" else result.transpose(2, 3)

    def column_diag(self, call, columns, name, batched):
        result = super().column_diag(call, columns, name, batched)
        return result if result is None else result.transpose(-1, -2)

    def grad_sum(self, call, name):
        result = super().grad_sum(call, name)
        return result if name == "bias" else result.T

    def projected_sum(self, call, name, u, v):
        """``sum_r (x_rᵀ u)(g_rᵀ v)``: the input side indexes the weight's rows."""
        return None if name == "bias" else _projected(call.input, call.grad_out, u, v)

    # kron_output_factor and kron_input_factor: Linear's, the input side first in the list

    def gradient_rows(self, call, name):
        """The weight's ``G = xᵀ g`` (``[nx, nf]``): ``(x [R, nx], g [R, nf])``."""
        rows = super().gradient_rows(call, name)
        return None if rows is None else rows[::-1]

    def eigen_correction(self, call, name, bases):
        """The weight's ``Σ_n (Q_Aᵀ x_nᵀ g_n Q_B)²``, input side first."""
        if name == "bias" or len(bases) != 2:
            return super().eigen_correction(call, name, bases)
        x, g = _flat(call)
        return eigen_moment(x, g, bases)

    def output_factor_index(self, name):
        return 1 if name == "weight" else 0

    def weighted_squares(self, module, x, r, name, batched):
        result = super().weighted_squares(module, x, r, name, batched)
        return result if name == "bias" else result.transpose(-1, -2)

    def kfra_weight(self, module):
        return None
