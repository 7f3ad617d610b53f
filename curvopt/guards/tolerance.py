"""The one tolerance policy of the checks: a comparison of ``a`` with ``b`` fails beyond
``factor * eps * max(|a|, |b|)``, with ``eps`` the unit roundoff of the least precise dtype
involved, or of the computation that made them (an autocast call computes in a lower precision
than its parameters: ``checks.Checks.note_precision``)."""

from __future__ import annotations

import math

import torch


def roundoff(*tensors, floor: float = 0.0) -> float:
    """Unit roundoff of the least precise floating dtype among ``tensors``, at least ``floor``."""
    eps = floor
    for t in tensors:
        if t is not None and t.is_floating_point():
            eps = max(eps, torch.finfo(t.dtype).eps)
    return eps


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
            b = b if b.dtype == a.dtype else b.to(a.dtype)
            live.setdefault(a.device, []).append((i, a, b, eps))
    for entries in live.values():
        # per pair, one fresh difference (its abs in place) and b's extremes
        read = torch.stack(
            [v for _, a, b, _ in entries for v in ((a - b).abs_().max(), *torch.aminmax(b))]
        ).tolist()
        for k, (i, a, b, eps) in enumerate(entries):
            gap, low, high = read[3 * k : 3 * k + 3]
            found[i] = _beyond(a, b, gap, max(-low, high), factor * eps)
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


def dense(grad: torch.Tensor) -> torch.Tensor:
    """A sparse gradient (``nn.Embedding(sparse=True)``) as the dense tensor it stands for."""
    return grad.coalesce().to_dense() if grad.is_sparse else grad
