"""A convolution's input-side Kronecker factor without unfolding: correlations and border strips.

For ``ConvNd`` with stride 1, dilation 1, one group and zero padding, the factor of the patches
(KFC, Grosse & Martens 2016), indexed ``(c, i), (c', j)`` like ``weight.flatten(1)`` (channel
``c``, kernel offset ``i ∈ [0, k)^D``), is, in the coordinates of the unpadded input
``x [N, C, *S]`` (zero outside ``[0, S)``) with the output locations ``m ∈ G`` shifted by the
padding before (``G_t = [-a_t, S_t + b_t - k_t + 1)`` per dimension, ``L = |G|``)::

    A[(c, i), (c', j)] = 1/(N L) Σ_n Σ_{m ∈ G} x[n, c, m + i] x[n, c', m + j].

Summed over every location whose patch meets the image, ``E_t = [-(k_t - 1), S_t) ∪ G_t``, the
sum depends on ``d = j - i`` only: the correlations ``R_d[c, c'] = Σ_{n, p} x[n, c, p]
x[n, c', p + d]``, ``d ∈ (-k, k)^D``, one convolution weight gradient (the input as input and as
output gradient, padding ``k - 1``, kernel ``2k - 1``): ``C² N |S| (2k - 1)^D`` multiply-adds
instead of the ``C² N L k^{2D}`` of the unfolded patches' Gram. ``G`` differs from ``E`` by the
border ``B_t = E_t \\ G_t`` (``k_t - 1 - a_t`` locations before, ``k_t - 1 - b_t`` after), so
``1[m ∈ G] = Π_t (1[m_t ∈ E_t] - 1[m_t ∈ B_t])``, expanded over the subsets ``T`` of the
dimensions (inclusion-exclusion)::

    A = 1/(N L) Σ_T (-1)^{|T|} Σ_{m_T ∈ B_T} Σ_{m_{~T} ∈ E_{~T}} x[m + i] x[m + j].

In a term, the dimensions outside ``T`` correlate as above (offset ``d_t = j_t - i_t``); those in
``T`` see only the image positions ``m_t + i_t`` of border locations: the strips ``P_t`` of
``k_t - 1 - a_t`` positions at the start and ``k_t - 1 - b_t`` at the end, thin (none where the
padding is ``k - 1`` or more). A term's correlations ``Q_T [(c, s), (c', s'), d_{~T}]`` are
those of the input restricted to the strips of ``T``, the strip positions as channels: for ``T``
empty the weight gradient above, for any other one matmul of the restricted input with its
windows of ``(2k - 1)^{D - |T|}`` offsets (small: the strips are thin). Each entry goes to the
factor's ``(i, j)`` with ``i, j`` per dimension: in ``T``, ``(s, s') = (m + i, m + j)`` for a
border location ``m`` (summed over them), outside ``T``, ``d = j - i`` (one ``index_add_``).

:func:`correlation_pays` is the shape rule for using it (:meth:`ConvRule.kron_input_factor`).
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import nn

from curvopt.layers.unfold import unfold

#: input channels from which the correlations' weight gradient does about as many multiply-adds
#: per second as the patches' matmul (with fewer it is several times slower per multiply-add)
_MIN_CHANNELS = 8
#: multiply-adds of the patches' Gram below which the correlations do not recover their fixed
#: cost (a few dozen small operations, about 1 ms on one CPU thread)
_MIN_GRAM_MACS = 10**8
#: the correlations are used where their multiply-adds are at most this fraction of the Gram's
#: (per multiply-add, a weight gradient is up to twice as slow as a matmul of the same size; on
#: one CPU thread a fraction of 0.34 took 0.6-0.8 of the Gram's time, 0.37-0.40 0.8-1.05, 0.63
#: took 1.25 of it; a 3x3 kernel on a large image, padding 1, is 25/81 = 0.31; not measured
#: on GPUs)
_COST_RATIO = 0.35
#: products that the weight gradient sums per entry at most: it sums them one after the other,
#: its float32 error growing with their count (about 3e-6 of the largest entry for 8192, ten
#: times the error of the blocked matmul of the patches' Gram), so the batch goes in chunks of
#: samples, as groups of one call, and the chunks' correlations are added (1.5-2.2 times the
#: matmul's error; the groups cost 0-10% more time)
_PRODUCTS_PER_SUM = 1024


def correlation_pays(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether :func:`correlation_input_factor` gives the factor of ``module`` (a ``ConvNd``)
    for its input ``x [N, C, *S]``, a rule on shapes: it applies (stride 1, dilation 1, one
    group, zero padding, float32 or float64, ``N L ≥ C prod(k)`` so that the patches' Gram
    would carry no root, ``reductions.gram_root``) and it pays (at least ``_MIN_CHANNELS``
    channels, a Gram of at least ``_MIN_GRAM_MACS`` multiply-adds, and at most
    ``_COST_RATIO`` of them: ``|S| (2k - 1)^D`` plus the strips' per channel pair and sample
    against ``L k^{2D}``; a 1x1 kernel has none to save)."""
    n, channels, *sizes = x.shape
    kernel, padding = module.kernel_size, _padding(module)
    if not (
        all(s == 1 for s in module.stride)
        and all(d == 1 for d in module.dilation)
        and module.groups == 1
        and module.padding_mode == "zeros"
        and x.dtype in (torch.float32, torch.float64)
        and channels >= _MIN_CHANNELS
    ):
        return False
    positions = math.prod(s + a + b - k + 1 for s, k, (a, b) in zip(sizes, kernel, padding))
    features = channels * math.prod(kernel)
    gram = n * positions * features**2
    if n * positions < features or gram < _MIN_GRAM_MACS:
        return False
    strips = [
        len(_strips(s, k, _borders(s, k, a, b))) for s, k, (a, b) in zip(sizes, kernel, padding)
    ]
    cost = 0
    for subset in itertools.product((False, True), repeat=len(sizes)):
        cost += math.prod(
            p * p if inside else s * (2 * k - 1)
            for inside, s, k, p in zip(subset, sizes, kernel, strips)
        )
    return n * channels**2 * cost <= _COST_RATIO * gram


def _padding(module: nn.Module) -> list[tuple[int, int]]:
    """The zero padding ``(before, after)`` of each spatial dimension (string padding too)."""
    flat = module._reversed_padding_repeated_twice  # last dimension first
    return [(flat[2 * t], flat[2 * t + 1]) for t in reversed(range(len(flat) // 2))]


def _borders(size: int, kernel: int, before: int, after: int) -> list[int]:
    """``B_t``: the locations (unpadded coordinates) whose patch meets the image but that the
    convolution does not visit."""
    return list(range(-(kernel - 1), -before)) + list(range(size + after - kernel + 1, size))


def _strips(size: int, kernel: int, border: list[int]) -> list[int]:
    """``P_t``: the image positions that the patches of the border locations see."""
    return sorted({m + i for m in border for i in range(kernel) if 0 <= m + i < size})


def correlation_input_factor(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The input-side factor ``A [C k, C k]`` of ``module`` (a ``ConvNd`` with stride 1,
    dilation 1, one group and zero padding, see :func:`correlation_pays`) from its input
    ``x [N, C, *S]``, channel-major like ``weight.flatten(1)``, by correlations and border
    strips (module docstring), never unfolding ``x``.

    Args:
        module: the convolution.
        x: its input (float32 or float64).

    Returns:
        ``1/(N L) Σ_{n, l} u_nl u_nlᵀ`` over the patches ``u_nl`` (``[C prod(k)]``) of ``x``.

    Example::

        conv = nn.Conv2d(16, 8, 3, padding=1)
        factor = correlation_input_factor(conv, torch.randn(32, 16, 16, 16))  # [144, 144]
    """
    n, channels, *sizes = x.shape
    kernel, padding = module.kernel_size, _padding(module)
    borders = [_borders(s, k, a, b) for s, k, (a, b) in zip(sizes, kernel, padding)]
    strips = [_strips(s, k, border) for s, k, border in zip(sizes, kernel, borders)]
    size = math.prod(kernel)
    factor = x.new_zeros(size * size, channels * channels)  # [(i, j), (c, c')]
    for subset in itertools.product((False, True), repeat=len(sizes)):
        if any(inside and not strip for inside, strip in zip(subset, strips)):
            continue  # no border in a dimension of the subset: the term is zero
        corr = _correlations(x, kernel, subset, strips)
        corr = corr.reshape(channels, channels, -1).permute(2, 0, 1).reshape(-1, channels**2)
        targets, sources = _entries(kernel, subset, borders, strips, x.device)
        sign = -1 if sum(subset) % 2 else 1
        factor.index_add_(0, targets, corr.index_select(0, sources), alpha=sign)
    positions = math.prod(s + a + b - k + 1 for s, k, (a, b) in zip(sizes, kernel, padding))
    factor = factor.view(size, size, channels, channels).permute(2, 0, 3, 1)
    return factor.reshape(channels * size, channels * size).div_(n * positions)


def _correlations(x, kernel, subset, strips) -> torch.Tensor:
    """``Q_T [C, C, z...]``, per dimension ``z = (s, s')`` (strip positions, a dimension in
    ``subset``) or ``e`` (the offset ``d + k - 1``, any other), in the order of the dimensions."""
    n, channels, *sizes = x.shape
    dims = len(sizes)
    inner = [t for t in range(dims) if subset[t]]
    outer = [t for t in range(dims) if not subset[t]]
    if not inner:  # the whole input: one weight gradient ``[C, C, *(2k - 1)]``
        return _whole_correlations(x, kernel)
    rows = x
    for t in inner:
        rows = rows.index_select(2 + t, torch.tensor(strips[t], device=x.device))
    # [N, C * prod(P_T), *S_~T]: the strip positions as channels
    rows = rows.permute(0, 1, *(2 + t for t in inner), *(2 + t for t in outer))
    width = channels * math.prod(len(strips[t]) for t in inner)
    rows = rows.reshape(n, width, *(sizes[t] for t in outer))
    wide = [2 * kernel[t] - 1 for t in outer]
    if outer:  # [N L, (2k - 1)^{~T} width], kernel offset-major
        windows = unfold(
            rows, wide, [1] * len(outer), [k // 2 for k in wide], [1] * len(outer), True
        )
        windows = windows.flatten(0, 1)
        rows = rows.movedim(1, -1).reshape(-1, width)
    else:
        windows = rows
    corr = rows.T @ windows  # [(c, s_T), (e_~T, c', s'_T)]
    shape = [channels, *(len(strips[t]) for t in inner)]
    corr = corr.view(*shape, *wide, *shape)
    # -> [C, C, per dimension (s, s') or e]
    left = {t: 1 + a for a, t in enumerate(inner)}
    offset = {t: len(shape) + a for a, t in enumerate(outer)}
    right = {t: len(shape) + len(wide) + 1 + a for a, t in enumerate(inner)}
    order = [0, len(shape) + len(wide)]
    for t in range(dims):
        order += [left[t], right[t]] if subset[t] else [offset[t]]
    return corr.permute(order)


def _whole_correlations(x, kernel) -> torch.Tensor:
    """``R [C, C, *(2k - 1)]`` (``R[c, c', d + k - 1] = Σ_{n, p} x[n, c, p] x[n, c', p + d]``)
    by one weight gradient. The batch is split into ``G`` chunks (the samples ``n ≡ g`` modulo
    ``G``), the chunks as groups of channels (``[N / G, G C, *S]``), ``G`` the least divisor
    of ``N`` with at most ``_PRODUCTS_PER_SUM`` products per sum, and the ``G`` results added."""
    n, channels, *sizes = x.shape
    dims = len(sizes)
    needed = -(-n * math.prod(sizes) // _PRODUCTS_PER_SUM)
    groups = next(g for g in range(max(1, min(needed, n)), n + 1) if n % g == 0)
    stacked = x.reshape(n // groups, groups * channels, *sizes)
    correlations = torch.ops.aten.convolution_backward(
        stacked,
        stacked,
        x.new_empty(groups * channels, channels, *(2 * k - 1 for k in kernel)),
        None,
        [1] * dims,
        [k - 1 for k in kernel],
        [1] * dims,
        False,
        [0] * dims,
        groups,
        [False, True, False],
    )[1]
    return correlations.view(groups, channels, *correlations.shape[1:]).sum(0)


def _entries(kernel, subset, borders, strips, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Where a term's correlations :func:`_correlations` (flattened over the dimensions' ``z``)
    go in the factor (flattened ``(i, j)``), one pair per entry: at ``(i, j)`` the sum over the
    border locations ``m`` of the term's dimensions of the entries at ``(s, s') = (m + i,
    m + j)`` (none where one is outside the strips), in the others the entry at
    ``e = j - i + k - 1``."""
    per_dimension = []  # per dimension: (i, j, z) and the radix of z
    for t, k in enumerate(kernel):
        if subset[t]:
            where = {p: s for s, p in enumerate(strips[t])}
            triples = [
                (i, j, where[m + i] * len(where) + where[m + j])
                for m in borders[t]
                for i in range(k)
                for j in range(k)
                if m + i in where and m + j in where
            ]
            per_dimension.append((triples, len(where) ** 2))
        else:
            triples = [(i, j, j - i + k - 1) for i in range(k) for j in range(k)]
            per_dimension.append((triples, 2 * k - 1))
    targets, sources = [], []
    for combination in itertools.product(*(triples for triples, _ in per_dimension)):
        i = j = z = 0
        for (a, b, e), k, (_, radix) in zip(combination, kernel, per_dimension):
            i, j, z = i * k + a, j * k + b, z * radix + e
        targets.append(i * math.prod(kernel) + j)
        sources.append(z)
    return torch.tensor(targets, device=device), torch.tensor(sources, device=device)
