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
    nothing to verify against (the gradient is visibly broken) and it is not one."""
    return mismatches([(a, b, floor)], factor)[0]


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
                [
                    v
                    for _, a, b, _ in (entries[k] for k in alone)
                    for v in ((a - b).abs_().max(), *torch.aminmax(b))
                ]
            )
        )
        for j, k in enumerate(alone):
            at[k] = (offset + 3 * j, offset + 3 * j + 1, offset + 3 * j + 2)
    read = (parts[0] if len(parts) == 1 else torch.cat(parts)).tolist()
    return [(read[g], read[lo], read[hi]) for g, lo, hi in at]


def _stack_extremes(a: torch.Tensor, b: torch.Tensor) -> list:
    """``[max |a_i - b_i|, min b_i, max b_i]``, each ``[m]``, of the pairs stacked in ``a`` and
    ``b`` (``[m, ...]``, one shape and dtype): one fresh difference, its abs in place; the
    extremes by ``amin`` and ``amax`` (on a CPU, ``aminmax`` along a dim takes 3-5x their
    time together)."""
    m = a.shape[0]
    b = b.reshape(m, -1)
    return [(a.reshape(m, -1) - b).abs_().amax(1), b.amin(1), b.amax(1)]


def segment_mismatches(flats, factor: float) -> list:
    """``mismatch(a_i, b_i, factor, floors[i])`` of every segment ``i`` of every
    ``(a, b, lengths, floors)`` in ``flats``, in order: ``a`` and ``b`` ``[K]`` of one dtype and
    device (``b`` the references), cut into segments of ``lengths`` (each at least 1; they
    add up to ``K``), ``floors`` their roundoff floors. The extremes of all segments of a flat
    are one operator (``max |a_i - b_i|`` and ``max |b_i|``, exact, NaN kept: ``_foreach_norm``
    with ``ord=inf``), all flats on one device read in one sync; a segment is decided in
    Python without a call where its sum is right (``gap <= bound * top``, finite), by
    ``_beyond`` otherwise."""
    read: dict = {}  # device -> [(max |a_i - b_i| of every segment, then max |b_i|)]
    for a, b, lengths, _ in flats:
        gaps, tops = (a - b).split_with_sizes(lengths), b.split_with_sizes(lengths)
        ends = torch._foreach_norm([*gaps, *tops], math.inf)
        read.setdefault(a.device, []).append(torch.stack(ends))
    values = {
        device: (parts[0] if len(parts) == 1 else torch.cat(parts)).tolist()
        for device, parts in read.items()
    }
    found: list = []
    at = dict.fromkeys(values, 0)
    for a, b, lengths, floors in flats:
        m, seen, start = len(lengths), values[a.device], at[a.device]
        at[a.device], first = start + 2 * m, len(found)
        found += [False] * m
        dtypes = roundoff(a, b)
        for i, floor in enumerate(floors):
            gap, top = seen[start + i], seen[start + m + i]
            bound = factor * (dtypes if dtypes >= floor else floor)  # factor * max(...)
            if not gap <= bound * top < math.inf:  # (a NaN gap compares False)
                segment = slice(sum(lengths[:i]), sum(lengths[: i + 1]))
                found[first + i] = _beyond(a[segment], b[segment], gap, top, bound)
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
