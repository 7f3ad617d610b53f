"""``nn.Linear`` with any number of leading dims: ``x [N, *, I] -> y = x W^T + b  [N, *, O]``.

With the positions ``t`` of the middle dims flattened (``x_nt``, ``g_nt = dL/dy_nt``):

* ``g_n(W) = sum_t g_nt x_nt^T``                         ``[N, O, I]``
* ``||g_n(W)||^2 = sum_{t,s} (g_nt . g_ns)(x_nt . x_ns)``  (ghost norm, ``T^2 (O+I)`` flops)
* ``sum_n g_n(W)**2 = (g**2)^T (x**2)``                  when ``T = 1``
* ``uᵀ (sum_n g_n(W)) v = sum_nt (g_nt . u)(x_nt . v)``  (the projected guard, ``(T N)(O+I)``)

Second order: Kronecker factors with the positions ``t`` as the shared dim (``layers.kron``);
the eigen-corrected moment from the rotated ``x`` and ``g`` (``layers.eigenbasis``);
the ``DiagHessian`` residual of a curved op on the output, ``sum_t r_nto x_nti^2``; the KFRA
link ``W`` (two-dimensional inputs).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from curvopt.layers.eigenbasis import eigen_moment, eigen_moment_of_vectors
from curvopt.layers.kron import input_factor, output_factor
from curvopt.layers.registry import LayerRule, register
from curvopt.core.reductions import sum_of_squares


def _flat(call):
    """``x [N, T, I]`` and ``g [N, T, O]`` with the middle dims flattened into ``T``."""
    x, g = call.input, call.grad_out
    n = g.shape[0]
    return x.reshape(n, -1, x.shape[-1]), g.reshape(n, -1, g.shape[-1])


def _bias_grad(g, out=None):
    """The bias's ``g_n = sum_t g_nt`` (``[N, O]``) of the output gradient ``g [N, *, O]``."""
    return torch.sum(g.reshape(g.shape[0], -1, g.shape[-1]), 1, out=out)


def _rows(call):
    """``x [N, I]`` and ``g [N, O]`` when every sample has one position (``T = 1``), else
    ``None``."""
    x, g = call.input, call.grad_out
    if x.dim() == 2:
        return x, g
    n = g.shape[0]
    if x.numel() != n * x.shape[-1]:
        return None
    return x.reshape(n, -1), g.reshape(n, -1)


def _projected(left, right, u, v):
    """``projected_sum`` of ``sum_r left_r right_rᵀ`` (rows: all dims but the last)."""
    left, right = left.reshape(-1, left.shape[-1]), right.reshape(-1, right.shape[-1])
    projected = ((left @ u.to(left.dtype)) * (right @ v.to(right.dtype))).sum(0)
    return projected, torch.linalg.vector_norm(left, dim=1) @ torch.linalg.vector_norm(right, dim=1)


def canonical_input(call, n: int):
    """Inputs ``x [N, T, I]`` in the canonical weight-sharing format of ``layers.kron``, the
    middle dims flattened into ``T``."""
    return call.input.reshape(n, -1, call.input.shape[-1])


def canonical_columns(columns, n: int):
    """Columns ``v [K, N, T, O]`` in the canonical format (as :func:`canonical_input`)."""
    return columns.reshape(columns.shape[0], n, -1, columns.shape[-1])


@register(nn.Linear)
class LinearRule(LayerRule):
    positionwise = True
    curvature_free = True

    def batch_grad(self, call, name, out=None):
        if name == "bias":
            return _bias_grad(call.grad_out, out)
        x, g = call.input, call.grad_out
        if x.dim() == 2:  # one position a sample: x [N, I], g [N, O], as _flat's [N, 1, *]
            return torch.mul(g.unsqueeze(2), x.unsqueeze(1), out=out)
        x, g = _flat(call)
        if x.shape[1] == 1:
            return torch.mul(g.transpose(1, 2), x, out=out)
        return torch.bmm(g.transpose(1, 2), x, out=out)

    def expanded_batch_grad(self, call, columns, name):
        """The bias's from the merged columns alone (its gradient reads no input)."""
        if name == "bias":
            return _bias_grad(call.expanded_grad(columns))
        return super().expanded_batch_grad(call, columns, name)

    def batch_l2(self, call, name):
        rows = _rows(call)
        if rows is not None:  # ||g_n x_n^T||^2 = ||g_n||^2 ||x_n||^2
            x, g = rows
            l2 = torch.linalg.vecdot(g, g)
            return l2 if name == "bias" else l2.mul_(torch.linalg.vecdot(x, x))
        x, g = _flat(call)
        if name == "bias":
            return g.sum(1).pow_(2).sum(1)
        t, i, o = x.shape[1], x.shape[2], g.shape[2]
        if t * (o + i) < o * i:
            return torch.einsum("nts,nts->n", g @ g.transpose(1, 2), x @ x.transpose(1, 2))
        return None

    def sum_grad_squared(self, call, name):
        rows = _rows(call)
        if rows is None:
            return _flat(call)[1].sum(1).pow_(2).sum(0) if name == "bias" else None
        x, g = rows
        g2 = g.square()
        return g2.sum(0) if name == "bias" else g2.T @ x.square()

    def column_grads(self, call, columns, name):
        """``[N, K, O, I]`` by one batched matmul over samples (inputs are not repeated)."""
        x = call.input
        k, n, o = columns.shape[0], columns.shape[1], columns.shape[-1]
        v = columns.reshape(k, n, -1, o)
        if name == "bias":
            return v.sum(2).transpose(0, 1)
        t = v.shape[2]
        v = v.permute(1, 0, 3, 2).reshape(n, k * o, t)
        return torch.bmm(v, x.reshape(n, t, x.shape[-1])).view(n, k, o, x.shape[-1])

    def column_diag(self, call, columns, name, batched):
        """Without positions (``T = 1``): ``sum_k v_nko^2 x_ni^2``, a product of two squares."""
        x = call.input
        if name == "bias" or math.prod(x.shape[1:-1]) != 1:
            return None
        if x.dim() > 2:  # ``[N, 1, ..., I]``: as ``[N, I]``, the columns as ``[K, N, O]``
            columns = columns.reshape(columns.shape[0], x.shape[0], -1)
            x = x.reshape(x.shape[0], -1)
        v2 = sum_of_squares(columns)  # [N, O]
        x2 = x.square()  # [N, I]
        return v2.unsqueeze(2) * x2.unsqueeze(1) if batched else v2.T @ x2

    def grad_sum(self, call, name):
        x, g = call.input, call.grad_out
        g = g.reshape(-1, g.shape[-1])
        return g.sum(0) if name == "bias" else g.T @ x.reshape(-1, x.shape[-1])

    def projected_sum(self, call, name, u, v):
        """``sum_r (g_rᵀ u)(x_rᵀ v)`` over the rows ``r`` (samples and positions)."""
        return None if name == "bias" else _projected(call.grad_out, call.input, u, v)

    def kron_output_factor(self, call, columns, name, approx, n):
        if name != "weight":
            return None  # the exact block of the bias (layers.kron)
        return output_factor(canonical_columns(columns, n), approx)

    def kron_input_factor(self, call, name, approx, n):
        return input_factor(canonical_input(call, n), approx)

    def gradient_rows(self, call, name):
        """The weight's ``G = gᵀ x``: ``(g [R, O], x [R, I])``."""
        if name != "weight":
            return None
        x, g = call.input, call.grad_out
        return g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])

    def eigen_correction(self, call, name, bases):
        """The weight's ``Σ_n (Q_Bᵀ g_nᵀ x_n Q_A)²`` from the rotated ``x`` and ``g``; over
        positions (``T > 1``) the bias's ``Σ_n (Q_Bᵀ g_n)²`` by one product for the batch."""
        x, g = _flat(call)
        if name == "bias" and g.shape[1] > 1 and len(bases) == 1:
            return eigen_moment_of_vectors(_bias_grad(g), bases[0])
        if name == "bias" or len(bases) != 2:
            return super().eigen_correction(call, name, bases)
        return eigen_moment(g, x, bases)

    def has_weighted_squares(self, module):
        return True

    def weighted_squares(self, module, x, r, name, batched):
        n = r.shape[0]
        rr = r.reshape(n, -1, r.shape[-1])
        if name == "bias":
            return rr.sum(1) if batched else rr.sum((0, 1))
        x2 = x.reshape(n, -1, x.shape[-1]).pow(2)
        return torch.einsum(f"nto,nti->{'n' if batched else ''}oi", rr, x2)

    def kfra_weight(self, module):
        return module.weight

    def kfra_factors(self, x, b, name):
        return [b.clone(), x.T @ x / x.shape[0]] if name == "weight" else [b.clone()]
