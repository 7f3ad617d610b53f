"""Curvature from one backward pass: square-root factors of the loss Hessian, propagated.

When the gradient reaches an extended loss (the first hook of a backward pass), the loss
supplies ``S`` with ``H_n = sum_k s_nk s_nk^T`` (exact columns, or Monte-Carlo columns from
sampled targets). PyTorch's autograd propagates all columns at once to the output of every
extended module (vector-Jacobian products batched over columns, ``is_grads_batched``), giving
``V = J_{y}^T S`` there; each module turns ``V`` and its saved input into diagonals or Kronecker
factors. Any graph works: residual adds, functional ops, attention, reused modules.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from typing import Dict, List, Tuple

import torch
from torch.autograd.graph import GradientEdge

from curvopt.errors import UnsupportedLossError
from curvopt.hooks import _METADATA, owned, trainable
from curvopt.layers import rule_for
from curvopt.layers.kron import kron_factors, output_factor_index
from curvopt.records import Call
from curvopt.reductions import sum_of_squares
from curvopt.state import STATE

#: bound on the elements of propagated columns held at once (all module outputs together)
_COLUMN_BUDGET = 1 << 25
#: bound on the elements of per-(column, sample) parameter gradients held at once
_GRAD_BUDGET = 1 << 24


class LossRecord:
    """One call of an extended loss: its input and target until the backward pass starts."""

    __slots__ = ("module", "args", "kwargs")

    def __init__(self, module, args, kwargs):
        self.module, self.args, self.kwargs = module, args, kwargs

    @property
    def output(self) -> torch.Tensor:
        return self.args[0]

    @property
    def target(self):
        return self.args[1] if len(self.args) > 1 else self.kwargs["target"]

    def on_grad(self, grad):
        if STATE.suspended or self.args is None:
            return
        try:
            if STATE.collecting is not None:
                STATE.collecting.backward_pass().on_loss(self, grad)
        finally:
            self.args = self.kwargs = None


def check_reduction(loss_module) -> None:
    if getattr(loss_module, "reduction", None) == "none":
        raise UnsupportedLossError(
            f"{type(loss_module).__name__}(reduction='none') returns per-sample losses, whose "
            "scaling curvopt cannot know; use reduction='mean' or 'sum'"
        )


# ------------------------------------------------------------------------ graph traversal
#: backward ops that ``vmap`` runs sample by sample (no batching rule in PyTorch): graphs with
#: them propagate columns one at a time, which is faster than the vmap fallback
_NO_BATCHING_RULE = {
    "MaxPool1DWithIndicesBackward0",
    "MaxPool2DWithIndicesBackward0",
    "MaxPool3DWithIndicesBackward0",
    "ScaledDotProductFlashAttentionForCpuBackward0",
    "ScaledDotProductEfficientAttentionBackward0",
    "ScaledDotProductFlashAttentionBackward0",
}


def module_outputs(root):
    """Extended-module calls upstream of ``root`` (a tensor or an autograd node):
    record -> [(output index, gradient edge)], and whether the graph may propagate columns
    batched (``vmap``) efficiently."""
    found: Dict[object, List[Tuple[int, GradientEdge]]] = defaultdict(list)
    start = root.grad_fn if isinstance(root, torch.Tensor) else root
    stack, seen, batchable = [start], set(), True
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        batchable = batchable and type(node).__name__ not in _NO_BATCHING_RULE
        for record, index, output_nr in node.metadata.get(_METADATA, ()):
            if record.args is not None:
                found[record].append((index, GradientEdge(node, output_nr)))
        stack.extend(fn for fn, _ in node.next_functions)
    return found, batchable


def backpropagate(outputs, edges, columns: torch.Tensor, batched: bool):
    """``J^T`` of each edge applied to every column (``[k, *out]`` per edge, None if unused)."""
    with STATE.suspend():
        if batched:
            return torch.autograd.grad(
                outputs,
                edges,
                columns,
                retain_graph=True,
                is_grads_batched=True,
                allow_unused=True,
            )
        per_column = [
            torch.autograd.grad(outputs, edges, column, retain_graph=True, allow_unused=True)
            for column in columns
        ]
    return [None if parts[0] is None else torch.stack(parts) for parts in zip(*per_column)]


def expand_call(call: Call, columns) -> Call:
    """The call seen by ``K`` columns as ``K * N`` pseudo-samples (index ``k * N + n``).

    ``columns`` are ``[K, *out]`` (a tuple for several outputs); batched inputs are repeated.
    """
    bd, n = call.batch_dim, call.batch_size
    first = next(
        c for c in (columns if isinstance(columns, tuple) else (columns,)) if c is not None
    )
    k = first.shape[0]

    def rep(x):
        if isinstance(x, torch.Tensor) and x.dim() > bd and x.shape[bd] == n:
            shape = list(x.shape)
            return x.unsqueeze(bd).expand(*shape[:bd], k, *shape[bd:]).flatten(bd, bd + 1)
        if isinstance(x, tuple):
            return tuple(rep(y) for y in x)
        return x

    def merge(v):
        return None if v is None else v.movedim(0, bd).flatten(bd, bd + 1)

    grad = tuple(merge(v) for v in columns) if isinstance(columns, tuple) else merge(columns)
    return Call(call.module, rep(call.args), {a: rep(b) for a, b in call.kwargs.items()}, grad, bd)


# ------------------------------------------------------------------------ per-module work
def diag_from_columns(rule, call: Call, columns, name: str, batched: bool, n: int):
    """``sum_k (J_n^T v_nk)**2`` summed over n (``batched=False``) or per n, ``[N, *p]``.

    Uses the rule's factorised ``column_diag`` where it has one; otherwise materialises
    ``[k, n, *p.shape]`` in chunks of columns and samples that stay within a budget.
    """
    fast = rule.column_diag(call, columns, name, batched)
    if fast is not None:
        return fast
    k = _first(columns).shape[0]
    numel = dict(owned(call.module))[name].numel()
    samples = max(1, min(n, _GRAD_BUDGET // max(1, numel)))
    step = max(1, _GRAD_BUDGET // max(1, samples * numel))
    per_sample = []
    for first in range(0, n, samples):
        last = min(n, first + samples)
        sub = call if (first, last) == (0, n) else call.slice(first, last)
        sub_columns = _narrow(columns, first, last, dim=1 + call.batch_dim)
        totals = None
        for start in range(0, k, step):
            chunk = _narrow(sub_columns, start, min(k, start + step))
            grads = rule.column_grads(sub, chunk, name)  # [n, k, *p]; may alias the columns
            squares = [sum_of_squares(g) for g in grads]
            totals = squares if totals is None else [t.add_(s) for t, s in zip(totals, squares)]
        per_sample.extend(totals)
    if batched:
        return torch.stack(per_sample)
    return functools.reduce(torch.Tensor.add_, per_sample)


def _first(columns) -> torch.Tensor:
    return (
        columns if isinstance(columns, torch.Tensor) else next(c for c in columns if c is not None)
    )


def _narrow(columns, start: int, stop: int, dim: int = 0):
    if isinstance(columns, torch.Tensor):
        return columns.narrow(dim, start, stop - start)
    return tuple(None if c is None else c.narrow(dim, start, stop - start) for c in columns)


class CurvaturePass:
    """Second-order work of one backward pass, run from the loss hook."""

    def __init__(self, backward_pass, loss_record: LossRecord, weight: torch.Tensor):
        self.bp = backward_pass
        self.loss = loss_record
        self.exts = backward_pass.second_order_exts
        w = float(weight)
        if w < 0:
            raise UnsupportedLossError(
                "the loss enters the backward pass with a negative factor, so its "
                "Gauss-Newton matrix is not positive semi-definite; curvopt cannot factor it"
            )
        self.scale = math.sqrt(w)

    def run(self) -> None:
        from curvopt.losses import loss_rule_for

        module, output, target = self.loss.module, self.loss.output, self.loss.target
        rule = loss_rule_for(module)
        rule.check(module, output.detach(), target)
        calls, self.batched = module_outputs(output)
        self._check_modules(calls)
        groups = defaultdict(list)
        for ext in self.exts:
            if ext.attr == "kfra":
                continue
            key = ("mc", ext.options["mc_samples"]) if ext.source == "mc" else ("exact", 0)
            groups[key].append(ext)
        for (source, mc_samples), exts in groups.items():
            self._propagate(rule, calls, exts, source, mc_samples)
        hessian_exts = [e for e in self.exts if e.attr in ("diag_h", "diag_h_batch")]
        if hessian_exts:
            from curvopt.hessian import add_residuals

            add_residuals(self, calls, hessian_exts)
        if any(ext.attr == "kfra" for ext in self.exts):
            from curvopt.kfra import kfra

            kfra(self, rule, calls)

    def _check_modules(self, calls) -> None:
        from curvopt.backward import module_error

        for record in calls:
            reason = rule_for(record.module).check(record.module)
            if reason is not None:
                raise module_error(record.module, reason)

    def columns(self, rule, source: str, mc_samples: int, chunk: int):
        """Chunks ``[k, *output.shape]`` of the (scaled) square-root factor."""
        module, output, target = self.loss.module, self.loss.output.detach(), self.loss.target
        if source == "mc":
            yield rule.sqrt_hessian_mc(module, output, target, mc_samples) * self.scale
            return
        total = rule.num_columns(module, output)
        for start in range(0, total, chunk):
            cols = rule.sqrt_hessian(
                module, output, target, columns=range(start, min(total, start + chunk))
            )
            yield cols * self.scale

    def _chunk_size(self, calls) -> int:
        """Columns per chunk so that all propagated columns fit in ``_COLUMN_BUDGET`` elements."""
        per_column = self.loss.output.numel() + sum(
            record.out_numel[index] for record, edges in calls.items() for index, _ in edges
        )
        return max(1, _COLUMN_BUDGET // per_column)

    def _propagate(self, rule, calls, exts, source, mc_samples) -> None:
        records = list(calls)
        edges = [edge for r in records for _, edge in calls[r]]
        kron_exts = [e for e in exts if e.attr in ("kfac", "kflr")]
        diag_exts = [e for e in exts if e not in kron_exts]
        for cols in self.columns(rule, source, mc_samples, self._chunk_size(calls)):
            back = backpropagate(self.loss.output, edges, cols, self.batched)
            it = iter(back)
            outs = {record: [next(it) for _ in calls[record]] for record in records}
            if diag_exts:
                add_diagonals(self.bp, calls, outs, diag_exts)
            for record in records:
                self._kron(record, outs[record], kron_exts)

    def _kron(self, record, outs, kron_exts) -> None:
        call, columns, n = module_call(record, outs)
        if call is None:
            return
        for name, p in trainable(record.module):
            for ext in kron_exts:
                factors = kron_factors(call, columns, name, p, ext.options["kfac_approx"], n)
                self.bp.add_kron(
                    p, ext.attr, record, factors, output_factor_index(call.module, name)
                )


def module_call(record, outs):
    """``(call, columns, N)`` for one module call given its propagated columns (None if unused)."""
    if all(v is None for v in outs):
        return None, None, 0
    columns = outs[0] if len(outs) == 1 else tuple(outs)
    rule = rule_for(record.module)
    call = Call(record.module, record.args, record.kwargs, None, rule.batch_dim(record.module))
    n = _batch_size(call, columns)
    call.grad_out = _zeros_like_sample(columns)
    return call, columns, n


def add_diagonals(bp, calls, outs, exts, sign: float = 1.0) -> None:
    """Add ``sign * sum_k (J^T v_k)**2`` (summed or per sample) for every parameter.

    A parameter reached through several calls (a reused module, tied weights) gets the squares
    of its summed per-(column, sample) gradients, not the sum of per-call squares.
    """
    uses = defaultdict(list)
    for record in calls:
        call, columns, n = module_call(record, outs[record])
        if call is None:
            continue
        for name, p in trainable(record.module):
            uses[id(p)].append((p, name, call, columns, n))
    for entries in uses.values():
        p = entries[0][0]
        for ext in exts:
            batched = ext.attr.endswith("_batch")
            if len(entries) == 1:
                _, name, call, columns, n = entries[0]
                d = diag_from_columns(rule_for(call.module), call, columns, name, batched, n)
            else:
                grads = sum(
                    rule_for(call.module).column_grads(call, columns, name)
                    for _, name, call, columns, _ in entries
                )  # [N, K, *p]
                d = torch.stack([sum_of_squares(g) for g in grads])
                d = d if batched else d.sum(0)
            bp.add(p, ext.attr, d.mul_(sign) if sign != 1.0 else d)


def _batch_size(call, columns) -> int:
    first = (
        columns if isinstance(columns, torch.Tensor) else next(c for c in columns if c is not None)
    )
    return first.shape[1 + call.batch_dim]


def _zeros_like_sample(columns):
    """A stand-in ``grad_out`` with the per-sample shape of the columns (for batch sizes)."""
    if isinstance(columns, torch.Tensor):
        return columns[0]
    return tuple(None if c is None else c[0] for c in columns)
