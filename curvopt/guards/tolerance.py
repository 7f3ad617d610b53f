"""The one tolerance policy of the checks: a comparison of ``a`` with ``b`` fails beyond
``factor * eps * max(|a|, |b|)``, with ``eps`` the unit roundoff of the least precise dtype
involved, or of the computation that made them (an autocast call computes in a lower precision
than its parameters: ``checks.Checks.note_precision``)."""

from __future__ import annotations

import math
from types import MappingProxyType

import torch


def roundoff(*tensors, floor: float = 0.0) -> float:
    """Unit roundoff of the least precise floating dtype among ``tensors``, at least ``floor``."""
    eps = floor
    for t in tensors:
        if t is not None:
            own = _EPS.get(t.dtype)
            if own is None and t.dtype.is_floating_point:
                own = torch.finfo(t.dtype).eps  # a floating dtype not listed (float8)
            if own is not None:
                eps = max(eps, own)
    return eps


#: ``torch.finfo(dtype).eps`` of the usual floating dtypes, read once (``finfo`` is a Python
#: call); a constant of torch, never changed
_EPS = MappingProxyType(
    {
        dtype: torch.finfo(dtype).eps
        for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    }
)


def mismatch(a, b, factor: float, floor: float = 0.0) -> bool:
    """``|a - b|`` beyond ``factor * roundoff(a, b, floor) * max(|a|, |b|)`` somewhere (the
    roundoff of both dtypes; ``b``, the reference, is compared in ``a``'s dtype).

    Non-finite values: where ``b`` is finite everywhere, a non-finite ``a`` (or a difference
    that overflows) is a mismatch, never a pass; where ``b`` itself is not finite there is
    nothing to verify against (the gradient is visibly broken) and it is not one.

    One pair is what :func:`mismatches` does for a pair it cannot stack: the same operators
    and one read, without its lists (about twenty Python calls fewer a comparison)."""
    if not a.numel():
        return False
    eps = roundoff(a, b, floor=floor)
    if b.dtype != a.dtype:
        b = b.to(a.dtype)
    gap, low, high = torch.stack(_pair_extremes(a, b)).tolist()
    top, bound = (high if high > -low else -low), factor * eps  # (``max``, no call)
    # (``_beyond``'s first test without a call, as :func:`stacked_mismatches` writes it)
    return False if gap <= bound * top < math.inf else _beyond(a, b, gap, top, bound)


def mismatches(pairs, factor: float) -> list:
    """``mismatch(a, b, factor, floor)`` of every ``(a, b, floor)`` in ``pairs``, the
    comparisons of all pairs on one device read in one sync."""
    found = [False] * len(pairs)
    live: dict = {}  # device -> [(position, a, b in a's dtype, eps)]
    for i, (a, b, floor) in enumerate(pairs):
        if a.numel():
            eps = roundoff(a, b, floor=floor)
            if b.dtype != a.dtype:
                b = b.to(a.dtype)
            live.setdefault(a.device, []).append((i, a, b, eps))
    for entries in live.values():
        for (i, a, b, eps), (gap, low, high) in zip(entries, _extremes(entries)):
            found[i] = _beyond(a, b, gap, max(-low, high), factor * eps)
    return found


#: from this many pairs on a device, those of one shape and dtype are stacked
_STACKED = 4


def _extremes(entries) -> list:
    """``(max |a - b|, min b, max b)`` of every pair of ``entries`` (``(i, a, b, eps)``, on one
    device), read in one sync: per pair one fresh difference (its abs in place) and ``b``'s
    extremes; pairs of one shape and dtype (both sides) stacked, so that each stage is one
    operator for all of them (the same differences, and exact extremes)."""
    groups: dict = {}  # (shape, dtype) or a lone pair's position -> positions in entries
    if len(entries) < _STACKED:
        groups = {k: [k] for k in range(len(entries))}
    for k, (_, a, b, _) in enumerate(entries if len(entries) >= _STACKED else ()):
        key = (a.shape, a.dtype) if a.shape == b.shape else k
        groups.setdefault(key, []).append(k)
    parts, at = [], [None] * len(entries)  # at[k]: where pair k's three values are read
    offset, alone = 0, []
    for members in groups.values():
        if len(members) < 2:
            alone += members
            continue
        m = len(members)
        a = torch.stack([entries[k][1] for k in members])
        b = torch.stack([entries[k][2] for k in members])
        parts += _stack_extremes(a, b)
        for j, k in enumerate(members):
            at[k] = (offset + j, offset + m + j, offset + 2 * m + j)
        offset += 3 * m
    if alone:
        parts.append(
            torch.stack(
                [v for _, a, b, _ in (entries[k] for k in alone) for v in _pair_extremes(a, b)]
            )
        )
        for j, k in enumerate(alone):
            at[k] = (offset + 3 * j, offset + 3 * j + 1, offset + 3 * j + 2)
    read = (parts[0] if len(parts) == 1 else torch.cat(parts)).tolist()
    return [(read[g], read[lo], read[hi]) for g, lo, hi in at]


def _pair_extremes(a: torch.Tensor, b: torch.Tensor) -> tuple:
    """``(max |a - b|, min b, max b)`` of one pair, 0-dim each: one fresh difference, its abs
    in place."""
    return ((a - b).abs_().max(), *torch.aminmax(b))


def _stack_extremes(a: torch.Tensor, b: torch.Tensor) -> list:
    """``[max |a_i - b_i|, min b_i, max b_i]``, each ``[m]``, of the pairs stacked in ``a`` and
    ``b`` (``[m, ...]``, one shape and dtype): one fresh difference, its abs in place; the
    extremes by ``amin`` and ``amax`` (on a CPU, ``aminmax`` along a dim takes 3-5x their
    time together)."""
    m = a.shape[0]
    b = b.reshape(m, -1)
    return [(a.reshape(m, -1) - b).abs_().amax(1), b.amin(1), b.amax(1)]


def stacked_mismatches(stacks, factor: float) -> list:
    """``mismatch(a[i], b[i], factor, floors[i])`` of every pair of every ``(a, b, floors)`` in
    ``stacks``, in order: ``a`` and ``b`` ``[m, ...]`` of one shape, dtype and device each
    (``b`` the references), ``floors`` ``m`` roundoff floors; a stack of one pair may give the
    pair itself (any shape, ``m = len(floors) = 1``). Each stack is four operators, all stacks
    on one device read in one sync (what :func:`mismatches` does for pairs it can stack, with
    the stacks made by the caller): ``max |a_i - b_i|`` and ``max |b_i|`` of all its pairs as
    the maxima of one joined ``[|a - b|; |b|]`` (``max |b|`` is ``max(-min b, max b)``
    exactly, and a NaN reaches both maxima); a pair whose sum is right is decided without a
    Python call."""
    read: dict = {}  # device -> [parts]
    for a, b, floors in stacks:
        if a.numel():
            gap = a - b
            if gap.shape != b.shape:  # (``b`` broadcast to ``a``: the values it compares)
                b = b.expand(gap.shape)
            joined = (torch.stack if len(floors) == 1 else torch.cat)([gap, b]).abs_()
            if joined.ndim > 1:  # ([2 m] maxima: the gaps, then the tops)
                joined = joined.amax(tuple(range(1, joined.ndim)))
            read.setdefault(a.device, []).append(joined)
    values = {device: torch.cat(parts).tolist() for device, parts in read.items()}
    found: list = []
    at = dict.fromkeys(values, 0)
    for a, b, floors in stacks:
        m, first = len(floors), len(found)
        found += [False] * m
        if not a.numel():
            continue
        seen, start = values[a.device], at[a.device]
        at[a.device] = start + 2 * m
        dtypes = roundoff(a)  # (``b`` has ``a``'s dtype)
        for i, floor in enumerate(floors):
            gap, top = seen[start + i], seen[start + m + i]
            # (``max(x, y)`` written out as ``y if y > x else x``, what it returns, no call)
            bound = factor * (floor if floor > dtypes else dtypes)
            # (``_beyond``'s first test, without indexing the stacks and without a call: a sum
            # that is right; a NaN gap compares False, an infinite one fails ``< inf``)
            if not gap <= bound * top < math.inf:
                pair = (a, b) if m == 1 else (a[i], b[i])
                found[first + i] = _beyond(*pair, gap, top, bound)
    return found


def _beyond(a, b, gap: float, top: float, bound: float) -> bool:
    """``mismatch``'s decision from ``gap = max |a - b|`` and ``top = max |b|``."""
    if not math.isfinite(gap):  # NaN or inf in a or b, or an overflow
        return bool(b.isfinite().all())
    # max(|a|, |b|) >= max |b| (and rounding is monotone): within the bound at max |b|, a sum
    # that is right reads one tensor fewer; only otherwise is max |a| read
    if gap <= bound * top:
        return False
    return gap > bound * float(max_abs(a, b))


def max_abs(*tensors) -> torch.Tensor:
    """``max |x|`` over ``tensors`` as ``max(|min x|, |max x|)``: no full-size ``|x|``."""
    return torch.stack([v for t in tensors for v in torch.aminmax(t)]).abs_().max()
