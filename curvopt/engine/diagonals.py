"""Diagonals from columns propagated to module outputs: ``sum_k (J_n^T v_nk)**2``.

``v`` are columns ``[K, *out]`` at a module's output (the loss-Hessian square root or
Hessian-residual columns, propagated); each module's rule turns them into per-(column, sample)
parameter gradients, or straight into their squares where it has a factorised form.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from curvopt.layers import mixes, rule_for
from curvopt.core.params import owned
from curvopt.core.calls import Call, first_column
from curvopt.core.reductions import sum_of_squares
from curvopt.engine.results import Term

#: bound on the elements of per-(column, sample) parameter gradients held at once (16 MB in
#: float32: 3C3D's 64 per-sample gradients of its second convolution, 39 MB, go in three
#: chunks; its Monte-Carlo diagonal peaks at BackPACK's memory, not 1.15x, at no loss of time)
_GRAD_BUDGET = 1 << 22
#: per-sample gradients ``[k, *p]`` up to this size are squared in one vectorised op
_VECTORISED = 1 << 16


def diag_from_columns(rule, call: Call, columns, name: str, p, batched: bool, n: int):
    """``sum_k (J_n^T v_nk)**2`` summed over n (``batched=False``) or per n, ``[N, *p]``, for
    the parameter ``p`` its module calls ``name``.

    Uses the rule's factorised ``column_diag`` where it has one; otherwise materialises
    ``[k, n, *p.shape]`` in chunks of columns and samples that stay within a budget.
    """
    fast = rule.column_diag(call, columns, name, batched)
    if fast is not None:
        return fast
    k = first_column(columns).shape[0]
    numel = p.numel()
    samples = max(1, min(n, _GRAD_BUDGET // max(1, numel)))
    step = max(1, _GRAD_BUDGET // max(1, samples * numel))
    per_sample = []
    for first in range(0, n, samples):
        last = min(n, first + samples)
        whole = (first, last) == (0, n)  # (the usual case: one chunk, the columns as they are)
        sub = call if whole else call.slice(first, last)
        sub_columns = columns if whole else narrow(columns, first, last, dim=1 + call.batch_dim)
        totals = None
        for start in range(0, k, step):
            stop = min(k, start + step)
            chunk = sub_columns if (start, stop) == (0, k) else narrow(sub_columns, start, stop)
            grads = rule.column_grads(sub, chunk, name)  # [n, k, *p]; may alias the columns
            squares = _squares_per_sample(grads) if batched else sum_of_squares(grads, dims=2)
            totals = squares if totals is None else totals.add_(squares)
        per_sample.append(totals)
    if len(per_sample) == 1:
        return per_sample[0]
    return torch.cat(per_sample) if batched else torch.stack(per_sample).sum(0)


def _squares_per_sample(grads: torch.Tensor) -> torch.Tensor:
    """``[n, k, *p] -> [n, *p]``, the sum over ``k`` of squares: one vectorised op for small
    samples, sample by sample (no temporary copy) for large ones."""
    if grads.shape[1] == 1:  # one column (Monte-Carlo): nothing to sum
        return grads[:, 0].square()
    if grads[0].numel() <= _VECTORISED:
        return grads.square().sum(1)
    return torch.stack([sum_of_squares(g) for g in grads])


def narrow(columns, start: int, stop: int, dim: int = 0):
    if isinstance(columns, torch.Tensor):
        return columns.narrow(dim, start, stop - start)
    return tuple(None if c is None else c.narrow(dim, start, stop - start) for c in columns)


def batch_column_grads(call, columns, name: str, n: int) -> torch.Tensor:
    """``[K, *p]``: ``sum_n J_n^T v_nk`` for every column ``k``, the gradient of ``v_k^T f``
    for the whole batch (``coupled``: the columns at the output hold every sample's share);
    summed over chunks of samples, never sliced where the module mixes samples."""
    rule = rule_for(call.module)
    numel = dict(owned(call.module))[name].numel() * first_column(columns).shape[0]
    samples = n if mixes(call.module) else max(1, min(n, _GRAD_BUDGET // max(1, numel)))
    total = None
    for first in range(0, n, samples):
        last = min(n, first + samples)
        sub = call if (first, last) == (0, n) else call.slice(first, last)
        part = rule.column_grads(sub, narrow(columns, first, last, dim=1 + call.batch_dim), name)
        total = part.sum(0) if total is None else total.add_(part.sum(0))
    return total


def diagonals(calls, outs, exts, sign: float = 1.0, coupled: bool = False):
    """``Term``s ``sign * sum_k (J^T v_k)**2`` (summed or per sample) for every parameter, one
    at a time (each is added to the result buffer before the next is computed).

    A parameter reached through several calls (a reused module, tied weights) gets the squares
    of its summed per-(column, sample) gradients, not the sum of per-call squares. ``coupled``
    (the columns went through a module that mixes samples): ``sum_k (sum_n J_n^T v_nk)**2``,
    the squares of the columns' batch gradients (``batch_column_grads``), summed only.
    """
    uses = defaultdict(list)
    for record in calls:
        call, columns, n = record.column_call(outs[record])
        if call is None:
            continue
        for name, p in record.computed():
            uses[id(p)].append((p, name, call, columns, n))
    for entries in uses.values():
        p = entries[0][0]
        if coupled:  # the square of the batch gradient of each column, summed over columns
            total = sum(batch_column_grads(c, v, name, n) for _, name, c, v, n in entries)
            yield from (Term(p, ext.attr, total.square().sum(0)) for ext in exts)
            continue
        for ext in exts:
            batched = ext.quantity.per_sample
            if len(entries) == 1:
                _, name, call, columns, n = entries[0]
                d = diag_from_columns(rule_for(call.module), call, columns, name, p, batched, n)
            else:
                grads = sum(
                    rule_for(call.module).column_grads(call, columns, name)
                    for _, name, call, columns, _ in entries
                )  # [N, K, *p]
                d = torch.stack([sum_of_squares(g) for g in grads])
                d = d if batched else d.sum(0)
            yield Term(p, ext.attr, d.mul_(sign) if sign != 1.0 else d)
