"""Several backward passes inside one ``collect`` (micro-batching), combined like ``p.grad``.

Pass ``i`` over ``N_i`` samples writes its quantities; the next pass combines them with what the
earlier passes wrote, as if all samples had been one batch of the objective the passes sum to.
How is each quantity's declared ``combine`` (``extensions.Combine``):

* ``CONCATENATE`` (per-sample quantities): along the batch;
* ``ADD`` (summed quantities);
* ``MOMENTS`` (``variance``): the pass hands ``(sum g^2, sum g)``, which add; the value is
  ``sum g^2 / N - (sum g / N)^2`` over all ``N`` samples so far;
* ``FACTORS`` (``values.KroneckerFactors``): the output-side factor adds, the input-side
  factor (a mean over samples) is averaged with weights ``N_i``; for a weight used by several
  calls, each call's factors so (``KroneckerFactors.sidewise``), and the value is the nearest
  Kronecker product of the combined calls' sum, that of one batch of all samples (the product
  of each pass's sum would not add); passes using the weight in other calls raise;
* ``RAISES`` (KFRA's recursively averaged factors): a second pass raises;
* ``SAME_BASIS`` (``ekfac = [S, *bases]``): ``S`` adds (each pass scaled by its own ``c``, so
  that it is that of the summed objective, as the GGN is) where both passes used the very same
  bases (supplied ones); fresh bases differ from pass to pass, and raise. An optimizer's
  collection (``collection.Collection``) supplies to its later passes the bases its first pass
  made (``Accumulator.bases``): its micro-batches accumulate in the basis of the last refresh.

A parameter of the pass's models that the pass does not reach (an unused head, a skipped
branch: ``participation.Participation.left_out``) holds no value of an earlier ``collect``
afterwards (:meth:`Accumulator.leave`). Its per-sample gradients are zero, and so is every
quantity built from them or from its curvature block; it gets those zeros (``N`` rows for this
pass), combined with the earlier passes of this ``collect`` by the rules above (an unused
parameter's ``grad_batch`` gets zero rows; its ``variance`` counts the pass's samples).
Kronecker factors and eigenbases are not defined without the parameter's inputs: a value of
an earlier ``collect`` is taken off (a value of this ``collect``'s earlier passes stays, as
zero would add to it), as is the diagonal written instead of them
(``collect(skip_unsupported="diagonal")``). A parameter the pass leaves out on purpose
(``backward(inputs=...)`` without it) gets nothing either: an earlier ``collect``'s value is
taken off.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from curvopt.errors import AccumulationError
from curvopt.extensions.quantity import Combine, Kind, Quantity, quantity
from curvopt.core.values import KroneckerFactors


class Accumulator:
    """What earlier passes of one ``collect`` wrote: ``(id(p), attr) -> (value, N)``."""

    def __init__(self):
        self.written: Dict[Tuple[int, str], Tuple[object, int]] = {}
        #: ``s`` of the passes so far: the sum of each pass's ``ResultBuffer.reduction_scale``,
        #: as their curvatures add (two micro-batches of ``loss / 2``: ``s = 1``)
        self.reduction_scale = 0.0

    def bases(self, p, attr: str):
        """The bases earlier passes wrote in ``p.<attr> = [S, *bases]``, or None."""
        old = self.written.get((id(p), attr))
        return None if old is None else list(old[0][1:])

    def release(self, params, extensions) -> None:
        """Take ``p.<attr>`` off each ``(name, p)`` of ``params``, for the ``attr`` of each of
        ``extensions`` that no earlier pass of this ``collect`` wrote: a value of an earlier
        ``collect``, which this pass replaces. Released when the pass reaches its loss, before
        it computes its own, it is not held beside it (a Kronecker factor of a 3136-wide layer
        is 39 MB); a pass that fails then leaves no value rather than a stale one."""
        attrs = [e.attr for e in extensions]
        for _, p in params:
            for attr in attrs:
                if (id(p), attr) not in self.written and attr in p.__dict__:
                    delattr(p, attr)

    def leave(self, left, extensions, n: int) -> None:
        """The pass (over ``n`` samples) wrote ``extensions`` for none of ``left``'s
        ``(p, excluded)``: on each ``p``, zero where that is the value (combined with the
        earlier passes of this ``collect``), else no value of an earlier ``collect``."""
        if not left:
            return
        quantities = []
        for ext in extensions:
            quantities.append((ext.quantity, ext.quantity.kind in _UNDEFINED))
            fallback = getattr(ext, "fallback", None)  # the diagonal instead of factors
            if fallback is not None:
                quantities.append((fallback, True))
        for p, excluded in left:
            for q, undefined in quantities:
                if excluded or undefined:
                    if (id(p), q.attr) not in self.written:
                        p.__dict__.pop(q.attr, None)
                else:
                    setattr(p, q.attr, self.combine(p, q.attr, _zero(q, p, n), n))

    def combine(self, p, attr: str, value, n: int):
        """``value`` of this pass (over ``n`` samples) combined with the earlier passes'."""
        rule = quantity(attr).combine
        key = (id(p), attr)
        old = self.written.get(key)
        if old is not None:
            value = _COMBINE[rule](attr, old[0], value, old[1], n)
            n = old[1] + n
        self.written[key] = (value, n)
        if rule is Combine.MOMENTS:
            sgs, total = value
            return (sgs / n).sub_((total / n).pow(2))
        return value


#: kinds of quantity that a parameter no pass reached has no value of
_UNDEFINED = (Kind.FACTORS, Kind.EIGEN_CORRECTED)


def _zero(q: Quantity, p, n: int):
    """What a pass over ``n`` samples hands ``combine`` for ``p.<q.attr>`` where ``p``'s
    per-sample gradients and curvature are zero: zeros of ``[n, ...]`` (per sample: the shape
    ``q.reference`` gives, else ``[n, *p.shape]``) or ``p.shape``, ``(0, 0)`` moments."""
    shape = p.shape
    if q.per_sample:
        rows = (n, *p.shape)
        shape = rows if q.reference is None else q.reference(torch.empty(rows, device="meta")).shape
    zero = torch.zeros(shape, dtype=p.dtype, device=p.device)
    return (zero, zero) if q.combine is Combine.MOMENTS else zero


def _factors(attr, old: KroneckerFactors, new: KroneckerFactors, n_old, n_new):
    total = n_old + n_new
    return old.sidewise(new, lambda o, f: o + f, lambda o, f: (o * n_old + f * n_new) / total)


def _raises(attr, *_):
    raise AccumulationError(
        f"p.{attr} of two backward passes in one collect do not combine (KFRA's recursion "
        "averages over each pass's own batch). Run one backward pass per collect or use "
        "KFLR/KFAC; see docs/support.md#several-backward-passes."
    )


def _same_basis(attr, old, new, *_):
    if len(old) != len(new) or any(a is not b for a, b in zip(old[1:], new[1:])):
        raise AccumulationError(
            f"p.{attr} of two backward passes in one collect are in different eigenbases (each "
            "pass's own factors'), so their S do not add. Supply the bases, "
            "EKFAC(bases={param: [Q_0, Q_1]}), or run one pass per collect; see "
            "docs/support.md#several-backward-passes."
        )
    return new.replaced([old.eigenvalues + new.eigenvalues, *new.bases])


_COMBINE = {
    Combine.CONCATENATE: lambda attr, old, new, *_: torch.cat([old, new]),
    Combine.ADD: lambda attr, old, new, *_: old + new,
    Combine.MOMENTS: lambda attr, old, new, *_: (old[0] + new[0], old[1] + new[1]),
    Combine.FACTORS: _factors,
    Combine.RAISES: _raises,
    Combine.SAME_BASIS: _same_basis,
}
