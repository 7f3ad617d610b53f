"""Several backward passes inside one ``collect`` (micro-batching), combined like ``p.grad``.

Pass ``i`` over ``N_i`` samples writes its quantities; the next pass combines them with what the
earlier passes wrote, as if all samples had been one batch of the objective the passes sum to:

* per-sample quantities (``grad_batch``, ``batch_l2``, ``*_batch``) are concatenated along
  the batch;
* summed quantities (``sum_grad_squared``, ``diag_*``) add;
* ``variance`` is recomputed from the summed moments: ``sum g^2 / N - (sum g / N)^2``;
* Kronecker factors: the output-side factor ``B`` adds, the input-side factor (a mean over
  samples) is averaged with weights ``N_i``; KFRA's recursively averaged factors do not
  combine and raise.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from curvopt.errors import AccumulationError

PER_SAMPLE = {"grad_batch", "batch_l2", "diag_ggn_exact_batch", "diag_ggn_mc_batch", "diag_h_batch"}
KRONECKER = {"kfac", "kflr", "kfra"}


class Accumulator:
    """What earlier passes of one ``collect`` wrote: ``(id(p), attr) -> (value, N)``."""

    def __init__(self):
        self.written: Dict[Tuple[int, str], Tuple[object, int]] = {}
        self.moments: Dict[int, Tuple[torch.Tensor, torch.Tensor, int]] = {}

    def combine(self, p, attr: str, value, n: int, out_index: int = 0):
        """``value`` of this pass (over ``n`` samples) combined with the earlier passes'."""
        key = (id(p), attr)
        old = self.written.get(key)
        if old is not None:
            value = _combine(attr, old[0], value, old[1], n, out_index)
            n = old[1] + n
        self.written[key] = (value, n)
        return value

    def variance(self, p, sgs: torch.Tensor, total: torch.Tensor, n: int) -> torch.Tensor:
        """The variance over all samples of this and the earlier passes."""
        old = self.moments.get(id(p))
        if old is not None:
            sgs, total, n = old[0] + sgs, old[1] + total, old[2] + n
        self.moments[id(p)] = (sgs, total, n)
        return (sgs / n).sub_((total / n).pow(2))


def _combine(attr, old, new, n_old, n_new, out_index):
    if attr in PER_SAMPLE:
        return torch.cat([old, new])
    if attr not in KRONECKER:
        return old + new
    if attr == "kfra":
        raise AccumulationError(
            "KFRA factors of two backward passes in one collect do not combine (each pass "
            "averages curvature over its own batch inside the recursion); run one backward pass "
            "per collect, or use KFLR/KFAC, whose factors accumulate"
        )
    total = n_old + n_new
    return [
        o + f if i == out_index else (o * n_old + f * n_new) / total
        for i, (o, f) in enumerate(zip(old, new))
    ]
