"""Convolutions ``nn.Conv{1,2,3}d`` (stride, padding, dilation, groups, padding modes), and
``ConvRuleBase``, what they share with the transposed ones (``conv_transpose``).

Convolution, with patches ``X_n = unfold(x_n)`` (``[C_in k, L]``) and ``G_n = dL/dy_n``
(``[C_out, L]``), per group: ``g_n(W) = G_n X_n^T``.

Second order: Kronecker factors with the conv locations as the shared dim and the patches as
inputs (KFC, Grosse & Martens 2016), and the ``DiagHessian`` residual of a curved op on the
output, ``sum_l r_nol X_nil^2`` (``groups=1``). With ``groups = G > 1`` the weight
``[C_out, C_in/G, *k]`` is ``G`` independent convolutions (group ``g``: output channels
``g C_out/G : (g+1) C_out/G`` from input channels ``g C_in/G : (g+1) C_in/G``), and its
curvature is approximated block-diagonally over them: every factor is stacked per group,
``B [G, C_out/G, C_out/G]`` from the group's output columns and ``A [G, C_in/G ∏k, C_in/G ∏k]``
from the group's patches, the bias's ``[B]`` likewise (:meth:`ConvRule.kron_groups`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from curvopt.layers.conv_input_factor import correlation_input_factor, correlation_pays
from curvopt.layers.eigenbasis import eigen_moment
from curvopt.layers.kron import input_factor_by_samples, output_factor_channels_first
from curvopt.layers.registry import LayerRule, register
from curvopt.core.calls import Call
from curvopt.layers.unfold import (
    kernel_major_to_channel_major,
    padded_conv_input,
    unfold_conv_input,
)


def _grouped_outer(left, right, groups, out):
    """``left [N, g*a, L]``, ``right [N, g*b, L]`` -> per group ``left right^T`` ``[N, g*a, b]``."""
    n, length = left.shape[0], left.shape[-1]
    if groups == 1:
        flat = None if out is None else out.view(n, left.shape[1], right.shape[1])
        return torch.bmm(left, right.transpose(1, 2), out=flat)
    left = left.reshape(n * groups, -1, length)
    right = right.reshape(n * groups, -1, length)
    flat = None if out is None else out.view(n * groups, left.shape[1], right.shape[1])
    return torch.bmm(left, right.transpose(1, 2), out=flat)


#: the size of the per-column operand from which one ``bmm`` per column beats rearranging it
#: (:func:`_column_outer`). Measured on one thread, float32, ten columns of first convolutions
#: (``C_in k`` of 25-75, 196-784 positions): 1.1-1.4x slower at 4-16 MB, 0.91-0.96x at 32 MB,
#: 0.54-0.80x at 64-128 MB
_BY_COLUMNS_BYTES = 24 << 20


def _column_outer(left, right, k: int, n: int, groups: int) -> torch.Tensor:
    """Per group ``left right^T`` where one operand is per column (batch ``K N``, k-major) and
    the other per sample (batch ``N``): ``[N, K, G*a, b]`` from ``[., G*a, L]``, ``[., G*b, L]``.

    Two layouts compute the same dot products over ``L`` (the same bits where the ``bmm``
    kernel's sums do not depend on the number of rows, as measured on this project's hosts): one
    ``bmm`` on the per-column operand rearranged sample-major (a copy of ``K N G c L`` entries,
    ``c`` its rows per group), or one ``bmm`` per column written into the result's column
    (a copy of the products, ``N K G a b`` entries). The second moves less where the per-sample
    operand has fewer rows per group than ``L`` (a first convolution: ``C_in k`` of 75 against
    784 positions), and it pays where the copy it saves is large (:data:`_BY_COLUMNS_BYTES`).
    """
    per_column_left = right.shape[0] == n
    samples, columns = (right, left) if per_column_left else (left, right)
    copy_bytes = columns.numel() * columns.element_size()
    by_columns = (
        samples.shape[1] // groups < samples.shape[-1] and copy_bytes >= _BY_COLUMNS_BYTES
    )
    outer = _column_outer_by_columns if by_columns else _column_outer_arranged
    return outer(left, right, k, n, groups, per_column_left)


def _column_outer_arranged(left, right, k, n, groups, per_column_left) -> torch.Tensor:
    """:func:`_column_outer` by one ``bmm`` on the per-column operand arranged sample-major."""

    def arrange(t):  # -> [N * G, K_t * c, L]
        t = t.reshape(-1, n, groups, t.shape[1] // groups, t.shape[-1]).permute(1, 2, 0, 3, 4)
        return t.reshape(n * groups, -1, t.shape[-1])

    lt, rt = arrange(left), arrange(right)
    a, b = left.shape[1] // groups, right.shape[1] // groups
    if per_column_left:
        out = torch.bmm(lt, rt.transpose(1, 2)).view(n, groups, k, a, b)
    else:
        out = torch.bmm(rt, lt.transpose(1, 2)).view(n, groups, k, b, a).transpose(-1, -2)
    return out.permute(0, 2, 1, 3, 4).reshape(n, k, groups * a, b)


def _column_outer_by_columns(left, right, k, n, groups, per_column_left) -> torch.Tensor:
    """:func:`_column_outer` by one ``bmm`` per column (the operands in the order, and so the
    products, of its rearranged ``bmm``)."""
    a, b = left.shape[1] // groups, right.shape[1] // groups
    length = left.shape[-1]
    out = left.new_empty(n, k, groups * a, b)

    def per_group(t):  # [N, G * c, L] -> [N * G, c, L]
        return t.reshape(n * groups, t.shape[1] // groups, length)

    for column in range(k):
        at = slice(column * n, (column + 1) * n)
        if per_column_left:
            product = torch.bmm(per_group(left[at]), per_group(right).transpose(1, 2))
        else:
            product = torch.bmm(per_group(right[at]), per_group(left).transpose(1, 2)).mT
        out[:, column] = product.reshape(n, groups * a, b)
    return out


#: per-group input channels from which one grouped convolution backward (samples as groups)
#: beats unfolding the input and a batched matmul for per-sample weight gradients
_GROUPED_MIN_CHANNELS = 16


def _weight_grad(module, x, g, per_sample: bool) -> torch.Tensor:
    """The weight gradient of a (transposed) convolution's call by the convolution's own weight
    backward (no unfolded copy): summed over samples (``w.shape``), or ``per_sample``
    (``[N, *w.shape]``) as the weight gradient of one convolution over the batch stacked along
    channels (``[1, N C_in, *S]``) with ``N`` times the module's groups."""
    if module.transposed:  # zero padding only (ConvTransposeRule.check)
        padding = tuple(module.padding)
        output_padding = [  # as the call made it (``output_size`` may set it)
            o - ((i - 1) * s - 2 * p + d * (k - 1) + 1)
            for o, i, s, p, d, k in zip(
                g.shape[2:],
                x.shape[2:],
                module.stride,
                padding,
                module.dilation,
                module.kernel_size,
            )
        ]
    else:
        x, padding = padded_conv_input(module, x)
        output_padding = [0] * len(padding)
    weight, n = module.weight, x.shape[0]
    if per_sample:
        g = g.reshape(1, n * g.shape[1], *g.shape[2:])
        x = x.reshape(1, n * x.shape[1], *x.shape[2:])
        weight = weight.new_empty(n * weight.shape[0], *weight.shape[1:])
    _, grads, _ = torch.ops.aten.convolution_backward(
        g,
        x,
        weight,
        None,
        module.stride,
        padding,
        module.dilation,
        module.transposed,
        output_padding,
        module.groups * (n if per_sample else 1),
        [False, True, False],
    )
    return grads.view(n, *module.weight.shape) if per_sample else grads


class ConvRuleBase(LayerRule):
    curvature_free = True
    function_methods = ("forward", "_conv_forward")

    def _operands(self, call):
        """``(left [N, *, L], right [N, *, L])`` with ``g_n(W) = left_n right_n^T`` per group."""
        raise NotImplementedError

    def _length(self, call) -> int:
        """``L``, the positions of :meth:`_operands` (without unfolding)."""
        raise NotImplementedError

    def batch_grad(self, call, name, out=None):
        g = call.grad_out
        n = g.shape[0]
        if name == "bias":
            return torch.sum(g.reshape(n, g.shape[1], -1), 2, out=out)
        weight = call.module.weight
        left, right = self._operands(call)
        result = _grouped_outer(left, right, call.module.groups, out)
        return result.view(n, *weight.shape)

    def column_grads(self, call, columns, name):
        """``[N, K, *w.shape]``; the input side is unfolded once, not repeated over columns."""
        k, n = columns.shape[:2]
        if name == "bias":
            return columns.reshape(k, n, columns.shape[2], -1).sum(3).transpose(0, 1)
        module = call.module
        left, right = self._operands(Call(module, call.args, call.kwargs, columns.flatten(0, 1)))
        return _column_outer(left, right, k, n, module.groups).view(n, k, *module.weight.shape)

    def batch_l2(self, call, name):
        g = call.grad_out
        n = g.shape[0]
        if name == "bias":
            return g.reshape(n, g.shape[1], -1).sum(2).pow_(2).sum(1)
        weight = call.module.weight
        a, b = weight.shape[0], weight[0].numel()  # the operands' rows (groups == 1)
        if call.module.groups != 1 or self._length(call) * (a + b) >= a * b:
            return None  # ghost norms (L^2 (a + b) flops) cost more than N L a b
        left, right = self._operands(call)
        gram_left = left.transpose(1, 2) @ left
        gram_right = right.transpose(1, 2) @ right
        return (gram_left * gram_right).sum((1, 2))

    def eigen_correction(self, call, name, bases):
        """The weight's ``Σ_n (Q_0ᵀ left_n right_nᵀ Q_1)²`` from the rotated operands, the
        locations ``L`` as shared positions (``groups > 1``: from ``batch_grad``)."""
        if name == "bias" or call.module.groups != 1 or len(bases) != 2:
            return super().eigen_correction(call, name, bases)
        left, right = self._operands(call)
        return eigen_moment(left.mT, right.mT, bases)

    def grad_sum(self, call, name):
        """``sum_n g_n`` from this call's input and output gradient; the weight's by the
        convolution's weight backward over the batch (what the plain backward costs)."""
        g = call.grad_out
        if name == "bias":
            return g.transpose(0, 1).reshape(g.shape[1], -1).sum(1)
        return _weight_grad(call.module, call.input, g, False)


@register(nn.Conv1d, nn.Conv2d, nn.Conv3d)
class ConvRule(ConvRuleBase):
    """Per-sample weight gradients (``batch_grad``, one column per sample) by one grouped
    convolution backward where the layer has ``_GROUPED_MIN_CHANNELS`` input channels per group
    or more, by unfolded patches otherwise (and for several columns per sample, which share
    one unfolding)."""

    def _grouped(self, module, name) -> bool:
        return name == "weight" and module.in_channels // module.groups >= _GROUPED_MIN_CHANNELS

    def batch_grad(self, call, name, out=None):
        if self._grouped(call.module, name):
            return _weight_grad(call.module, call.input, call.grad_out, True)
        return super().batch_grad(call, name, out)

    def column_grads(self, call, columns, name):
        if columns.shape[0] == 1 and self._grouped(call.module, name):
            return _weight_grad(call.module, call.input, columns[0], True).unsqueeze(1)
        return super().column_grads(call, columns, name)

    def _operands(self, call):
        g = call.grad_out
        n = g.shape[0]
        return g.reshape(n, g.shape[1], -1), unfold_conv_input(call.module, call.input)

    def projected_sum(self, call, name, u, v):
        """``sum_{n,l} (G_nlᵀ u)(X_nlᵀ v)`` per group, without unfolding: ``X v`` is the
        convolution of the input with ``v`` as ``K`` filters (each group's input with the same
        ``v``), the patches' squared norms that of the input's squares summed over each
        group's channels with a filter of ones."""
        if name == "bias":
            return None
        module, g = call.module, call.grad_out
        groups, k, n = module.groups, u.shape[1], g.shape[0]
        x, padding = padded_conv_input(module, call.input)

        def convolve(inputs, filters):  # ``[N, G, ·, L]``
            out = torch.ops.aten.convolution(
                inputs,
                filters,
                None,
                module.stride,
                padding,
                module.dilation,
                False,
                [0] * len(padding),
                groups,
            )
            return out.reshape(n, groups, -1, out[0, 0].numel())

        g = g.reshape(n, groups, -1, g[0, 0].numel())  # [N, G, O/G, L]
        probed = torch.matmul(u.to(g.dtype).reshape(groups, -1, k).transpose(1, 2), g)
        filters = v.to(x.dtype).T.reshape(k, *module.weight.shape[1:])
        filters = filters.repeat(groups, *[1] * (x.dim() - 1))
        projected = (probed * convolve(x, filters)).sum((0, 1, 3))
        squares = x.square().reshape(n, groups, -1, *x.shape[2:]).sum(2)  # [N, G, *S]
        ones = x.new_ones(groups, 1, *module.kernel_size)
        patch_norms = convolve(squares, ones).sqrt_()[:, :, 0]
        return projected, (g.square().sum(2).sqrt_() * patch_norms).sum()

    def _length(self, call):
        return call.grad_out[0, 0].numel()

    def gradient_rows(self, call, name):
        """The weight's ``G = Σ_n left_n right_nᵀ`` (``groups == 1``) over the patches: the
        output gradients ``[N L, C_out]`` and the unfolded inputs ``[N L, C_in k]``."""
        if name != "weight" or call.module.groups != 1:
            return None
        left, right = self._operands(call)
        return left.mT.reshape(-1, left.shape[1]), right.mT.reshape(-1, right.shape[1])

    def kron_groups(self, module, name):
        return module.groups

    def kron_output_factor(self, call, columns, name, approx, n):
        module = call.module
        if name != "weight":
            return None  # the exact block of the bias (layers.kron), per group
        v = columns.reshape(columns.shape[0] * n, columns.shape[2], -1)  # [K N, C_out, L]
        return output_factor_channels_first(v, approx, module.groups)

    def kron_input_factor(self, call, name, approx, n):
        """The patches' Gram ``A`` (``layers.kron``); for "expand" where the shape rule
        ``conv_input_factor.correlation_pays`` holds, the same matrix from the input's
        correlations, without unfolding (``layers.conv_input_factor``)."""
        module = call.module
        x, groups = call.input, module.groups
        if approx == "expand" and correlation_pays(module, x):
            return correlation_input_factor(module, x)
        features = module.in_channels * math.prod(module.kernel_size)
        positions = x[0].numel() // module.in_channels // math.prod(module.stride)  # about
        if groups == 1:

            def patches(start, stop):  # [stop - start, L, k C_in]
                return unfold_conv_input(module, x[start:stop], positions_first=True)

            factor = input_factor_by_samples(patches, x.shape[0], positions, features, approx)
            return kernel_major_to_channel_major(factor, module.in_channels)

        def group_patches(start, stop):  # [G, stop - start, L, C_in/G k], channel-major
            rows = unfold_conv_input(module, x[start:stop])  # [n, C_in k, L]
            rows = rows.view(rows.shape[0], groups, -1, rows.shape[-1])
            # one copy in runs of L, each group's [C_in/G k, n L] contiguous for its Gram
            rows = rows.permute(1, 2, 0, 3).contiguous()
            return rows.permute(0, 2, 3, 1)

        return input_factor_by_samples(group_patches, x.shape[0], positions, features, approx)

    def has_weighted_squares(self, module):
        return module.groups == 1

    def weighted_squares(self, module, x, r, name, batched):
        n = r.shape[0]
        rr = r.reshape(n, r.shape[1], -1)
        if name == "bias":
            return rr.sum(2) if batched else rr.sum((0, 2))
        x2 = unfold_conv_input(module, x).pow(2)
        out = torch.einsum(f"nol,nil->{'n' if batched else ''}oi", rr, x2)
        return out.reshape(*out.shape[:-2], *module.weight.shape)
