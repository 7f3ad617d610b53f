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
empty the weight gradient above, for any other the same weight gradient of the restricted input
in the dimensions outside ``T`` (small: the strips are thin; a matmul where ``T`` holds them
all). Each entry goes to the
factor's ``(i, j)`` with ``i, j`` per dimension: in ``T``, ``(s, s') = (m + i, m + j)`` for a
border location ``m`` (summed over them), outside ``T``, ``d = j - i`` (one ``index_add_``).

A term's correlations are symmetric, ``Q_T [(c, s), (c', s'), d] = Q_T [(c', s'), (c, s), -d]``,
so in the first dimension ``h`` outside ``T`` only the offsets ``d_h ∈ [0, k_h)`` are computed
(``k_h`` of the ``2 k_h - 1``: the weight gradient of a kernel ``k_h`` wide there, the input
padded after only); an entry with ``d_h < 0`` is read from the transposed channel pair at
``-d`` with ``s, s'`` swapped. Which entries go where depends on the shapes only: each input
shape's index maps are built once (:func:`_terms`, a memo of a pure function of integers).

:func:`correlation_pays` is the shape rule for using it (:meth:`ConvRule.kron_input_factor`).
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


#: input channels from which the correlations' weight gradient does about as many multiply-adds
#: per second as the patches' matmul (with fewer it is several times slower per multiply-add)
_MIN_CHANNELS = 8
#: multiply-adds of the patches' Gram below which the correlations do not recover their fixed
#: cost (about 20 small operations, 0.5 ms on one CPU thread; channels 8-32, 3x3 and 5x5
#: kernels with padding k // 2, one thread: a Gram of 4-5e7 took 0.8-1.45 of the unfolded
#: route's time, one of 8-10e7 0.65-0.9)
_MIN_GRAM_MACS = 6 * 10**7
#: the correlations are used where their multiply-adds (:func:`_term_macs`) are at most this
#: fraction of the Gram's (per multiply-add, a weight gradient is up to twice as slow as a
#: matmul of the same size, the strips' matmuls slower where they are wide; on one CPU thread,
#: Grams of 2e8-1.5e9: fractions of 0.21-0.24 took 0.4-0.87 of the unfolded route's time,
#: 0.31 (5x5, padding 1) 1.0-1.3, 0.35-0.39 (no padding) 0.76-1.2, 0.5 and more 1.5-6; a 3x3
#: kernel on a large image, padding 1, is 15/81 = 0.19; not measured on GPUs)
_COST_RATIO = 0.28
#: products that the weight gradient sums per entry at most: it sums them one after the other,
#: its float32 error growing with their count (about 3e-6 of the largest entry for 8192, ten
#: times the error of the blocked matmul of the patches' Gram), so the batch goes in chunks of
#: samples, as groups of one call, and the chunks' correlations are added (2.7-4.5 float32
#: epsilons of the largest entry over eight seeds, the matmul 1.3-2.5, about 20 without the
#: chunks; the groups cost 0-10% more time)
_PRODUCTS_PER_SUM = 1024


def correlation_pays(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether :func:`correlation_input_factor` gives the factor of ``module`` (a ``ConvNd``)
    for its input ``x [N, C, *S]``, a rule on shapes: it applies (stride 1, dilation 1, one
    group, zero padding, float32 or float64, ``N L ≥ C prod(k)`` so that the patches' Gram
    would carry no root, ``reductions.gram_root``) and it pays (at least ``_MIN_CHANNELS``
    channels, a Gram of at least ``_MIN_GRAM_MACS`` multiply-adds, and at most
    ``_COST_RATIO`` of them: the terms' multiply-adds per channel pair and sample,
    :func:`_term_macs`, against ``L k^{2D}``; a 1x1 kernel has none to save)."""
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
    cost = sum(
        _term_macs(inner, sizes, kernel, strips)
        for inner in itertools.product((False, True), repeat=len(sizes))
    )
    return n * channels**2 * cost <= _COST_RATIO * gram


def _term_macs(inner, sizes, kernel, strips) -> int:
    """The multiply-adds per channel pair and sample of the term of the dimensions ``inner``
    (``T``): per dimension ``p_t²`` in ``T`` (``p_t`` strip positions), ``|S_t| k_t`` in the
    first one outside ``T`` (the offsets ``d ≥ 0``), ``|S_t| (2 k_t - 1)`` in the others."""
    outer = [t for t in range(len(sizes)) if not inner[t]]
    return math.prod(
        strips[t] ** 2
        if inner[t]
        else sizes[t] * (kernel[t] if t == outer[0] else 2 * kernel[t] - 1)
        for t in range(len(sizes))
    )


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
    kernel, padding = tuple(module.kernel_size), tuple(_padding(module))
    whole, *borders = _terms(tuple(sizes), kernel, padding, x.device)
    # [(i, j), (c, c')]: the whole input's term gives every entry once, in order
    factor = _table(x, kernel, whole).index_select(0, whole.sources)
    for term in borders:
        entries = _table(x, kernel, term).index_select(0, term.sources)
        factor.index_add_(0, term.targets, entries, alpha=term.sign)
    positions = math.prod(s + a + b - k + 1 for s, k, (a, b) in zip(sizes, kernel, padding))
    size = math.prod(kernel)
    reordered = factor.view(size, size, channels, channels).permute(2, 0, 3, 1)
    out = x.new_empty(channels, size, channels, size)
    torch.div(reordered, n * positions, out=out)  # the reordering copy, scaled on the way
    return out.view(channels * size, channels * size)


class _Term(NamedTuple):
    """One term of the inclusion-exclusion (module docstring), all that depends on the shapes
    only: its dimensions ``T`` (``inner``) and the others (``outer``), the strips ``P_t`` of
    ``T``, per dimension outside ``T`` the zero padding ``before`` the restricted input (``k -
    1 - before`` after) and the offsets' count ``wide``, the offset ``d = 0``'s index among
    them (``centre``), the ``order`` that puts the matmul's ``[C, *P_T, *wide, C, *P_T]`` as
    ``[z..., C, C]``, and where its correlations go: ``factor[targets] += sign *
    table[sources]`` (flattened ``(i, j)`` and rows of :func:`_table`)."""

    inner: tuple[int, ...]
    outer: tuple[int, ...]
    strips: tuple[torch.Tensor, ...]
    before: tuple[int, ...]
    wide: tuple[int, ...]
    centre: int
    order: tuple[int, ...]
    targets: torch.Tensor
    sources: torch.Tensor
    sign: int


@functools.lru_cache(maxsize=64)
def _terms(sizes: tuple, kernel: tuple, padding: tuple, device) -> tuple[_Term, ...]:
    """The terms of an input of spatial sizes ``sizes`` (a pure function of integers, kept for
    each shape: the index maps cost more than the small layers' arithmetic; their tensors on
    ``device``), the whole input's first, its entries in the order of ``(i, j)``; none for a
    dimension set with no strips."""
    borders = [_borders(s, k, a, b) for s, k, (a, b) in zip(sizes, kernel, padding)]
    strips = [_strips(s, k, border) for s, k, border in zip(sizes, kernel, borders)]
    terms = []
    for subset in itertools.product((False, True), repeat=len(sizes)):
        if any(t and not strip for t, strip in zip(subset, strips)):
            continue  # no border in a dimension of the subset: the term is zero
        inner = tuple(t for t in range(len(sizes)) if subset[t])
        outer = tuple(t for t in range(len(sizes)) if not subset[t])
        before = tuple(0 if a == 0 else kernel[t] - 1 for a, t in enumerate(outer))
        wide = tuple(kernel[t] + b for t, b in zip(outer, before))
        centre = sum(b * math.prod(wide[a + 1 :]) for a, b in enumerate(before))  # d = 0
        order = []  # of [C, *P_T, *wide, C, *P_T]
        for t in range(len(sizes)):
            if subset[t]:
                a = inner.index(t)
                order += [1 + a, 2 + len(inner) + len(wide) + a]
            else:
                order.append(1 + len(inner) + outer.index(t))
        order += [0, 1 + len(inner) + len(wide)]
        pairs = sorted(_entries(kernel, subset, borders, strips))
        terms.append(
            _Term(
                inner,
                outer,
                tuple(torch.tensor(strips[t], device=device) for t in inner),
                before,
                wide,
                centre,
                tuple(order),
                torch.tensor([target for target, _ in pairs], dtype=torch.long, device=device),
                torch.tensor([source for _, source in pairs], dtype=torch.long, device=device),
                -1 if len(inner) % 2 else 1,
            )
        )
    return tuple(terms)


def _table(x, kernel, term) -> torch.Tensor:
    """A term's correlations ``[Z, C²]`` (``(c, c')`` flattened): rows ``z`` flattened over
    the dimensions, per dimension ``(s, s')`` (strip positions, in ``T``), ``d`` (the first
    dimension outside ``T``, ``d ∈ [0, k)``) or ``d + k - 1`` (the others); where a dimension
    lies outside ``T``, followed by the same rows with ``(c, c')`` transposed (read at ``-d``,
    ``(s', s)``)."""
    channels = x.shape[1]
    if term.inner:
        table = _strip_correlations(x, term).reshape(-1, channels, channels)
    else:
        table = _correlations(x, kernel).view(channels, channels, -1).permute(2, 0, 1)
    if not term.outer:
        return table.view(-1, channels * channels)
    return torch.cat([table, table.transpose(1, 2)]).view(-1, channels * channels)


def _strip_correlations(x, term) -> torch.Tensor:
    """``Q_T [z..., C, C]`` of a term with strips (``T`` not empty; ``z`` as in
    :func:`_table`): one matmul of the input restricted to the strips, the strip positions
    as channels (``W = C prod(P_T)`` columns), with its windows outside ``T``: the restricted
    input zero-padded (``k - 1`` after in the first dimension outside ``T``, on both sides in
    the others) and viewed at every offset ``[N L, prod(wide) W]``, the columns of the offset
    ``d = 0`` as the other operand."""
    n, channels, *sizes = x.shape
    rows = x
    for t, strip in zip(term.inner, term.strips):
        rows = rows.index_select(2 + t, strip)
    # [N, *S_~T, C, *P_T]: the strip positions as channels, last
    rows = rows.permute(0, *(2 + t for t in term.outer), 1, *(2 + t for t in term.inner))
    width = math.prod(rows.shape[1 + len(term.outer) :])
    if term.outer:
        outer_sizes = [sizes[t] for t in term.outer]
        padded = x.new_zeros(n, *(s + w - 1 for s, w in zip(outer_sizes, term.wide)), width)
        padded[(slice(None), *(slice(b, b + s) for s, b in zip(outer_sizes, term.before)))] = (
            rows.reshape(n, *outer_sizes, width)
        )
        strides = padded.stride()[1:-1]
        windows = padded.as_strided(
            (n, *outer_sizes, *term.wide, width), (padded.stride(0), *strides, *strides, 1)
        ).reshape(-1, math.prod(term.wide) * width)  # [N L, (e, c', s'_T)]
        corr = windows[:, term.centre * width : (term.centre + 1) * width].T @ windows
    else:
        rows = rows.reshape(n, width)
        corr = rows.T @ rows
    # [(c, s_T), (e_~T, c', s'_T)] -> [z..., c, c'], per dimension (s, s') or e
    strips = [len(strip) for strip in term.strips]
    return corr.view(channels, *strips, *term.wide, channels, *strips).permute(term.order)


def _correlations(x, kernel) -> torch.Tensor:
    """``R [C, C, k_1, (2k - 1)...]`` of ``x [N, C, *S]`` (``R[c, c', d + k - 1] = Σ_{n, p}
    x[n, c, p] x[n, c', p + d]``, in the first dimension ``R[c, c', d]``, ``d ≥ 0``) by one
    weight gradient, the input padded by ``k - 1`` after in the first dimension and on both
    sides in the others. The batch is split into ``G`` chunks (the samples ``n ≡ g`` modulo
    ``G``), the chunks as groups of channels (``[N / G, G C, *S]``), ``G`` the least divisor
    of ``N`` with at most ``_PRODUCTS_PER_SUM`` products per sum, and the ``G`` results
    added."""
    n, channels, *sizes = x.shape
    dims = len(sizes)
    needed = -(-n * math.prod(sizes) // _PRODUCTS_PER_SUM)
    groups = next(g for g in range(max(1, min(needed, n)), n + 1) if n % g == 0)
    stacked = x.reshape(n // groups, groups * channels, *sizes)
    padded = F.pad(stacked, [0, 0] * (dims - 1) + [0, kernel[0] - 1])
    correlations = torch.ops.aten.convolution_backward(
        stacked,
        padded,
        x.new_empty(groups * channels, channels, kernel[0], *(2 * k - 1 for k in kernel[1:])),
        None,
        [1] * dims,
        [0, *(k - 1 for k in kernel[1:])],
        [1] * dims,
        False,
        [0] * dims,
        groups,
        [False, True, False],
    )[1]
    if groups == 1:
        return correlations
    return correlations.view(groups, channels, *correlations.shape[1:]).sum(0)


def _entries(kernel, inner, borders, strips) -> list[tuple[int, int]]:
    """Where a term's rows of :func:`_table` go in the factor (flattened ``(i, j)``), one
    pair ``(target, source)`` per entry: at ``(i, j)`` the sum over the border locations
    ``m`` of the dimensions in ``T`` of the rows at ``(s, s') = (m + i, m + j)`` (none where
    one is outside the strips), in the others at ``d = j - i``; where ``d < 0`` in the first
    dimension outside ``T``, the transposed rows at ``-d`` and ``(s', s)``."""
    outer = [t for t in range(len(kernel)) if not inner[t]]
    per_dimension = []  # per dimension: (i, j, row, transposed row) and the radix of the rows
    for t, k in enumerate(kernel):
        if inner[t]:
            where = {p: s for s, p in enumerate(strips[t])}
            quadruples = [
                (
                    i,
                    j,
                    where[m + i] * len(where) + where[m + j],
                    where[m + j] * len(where) + where[m + i],
                )
                for m in borders[t]
                for i in range(k)
                for j in range(k)
                if m + i in where and m + j in where
            ]
            per_dimension.append((quadruples, len(where) ** 2))
        elif t == outer[0]:
            quadruples = [(i, j, j - i, i - j) for i in range(k) for j in range(k)]
            per_dimension.append((quadruples, k))
        else:
            quadruples = [(i, j, j - i + k - 1, i - j + k - 1) for i in range(k) for j in range(k)]
            per_dimension.append((quadruples, 2 * k - 1))
    rows = math.prod(radix for _, radix in per_dimension)  # of the untransposed half
    pairs = []
    for combination in itertools.product(*(quadruples for quadruples, _ in per_dimension)):
        transposed = bool(outer) and combination[outer[0]][2] < 0
        i = j = z = 0
        for (a, b, e, f), k, (_, radix) in zip(combination, kernel, per_dimension):
            i, j, z = i * k + a, j * k + b, z * radix + (f if transposed else e)
        pairs.append((i * math.prod(kernel) + j, z + rows if transposed else z))
    return pairs
