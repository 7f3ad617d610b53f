"""The sum checks of one backward pass, each raising before anything is written.

* every parameter that received a gradient was seen through its module's call;
* the per-sample gradients of each parameter sum to its gradient (a parameter also used
  outside its module, e.g. a tied head ``h @ emb.weight.T``, breaks this), in full or through
  random probes (``projected``);
* for curvature, every parameter with a gradient gets every requested curvature attribute
  (that the gradient enters through the extended losses alone is ``flow``'s check).

The per-sample sums of a curvature-only pass, and of a pass whose per-sample gradients feed
only ``EKFAC``'s ``S`` (a curvature quantity), are checked on the first pass of each graph
structure (its ``core.plans.Plan.sums_checked``): with the flow checked on every pass, what a
sum check adds (a parameter used again inside the losses' graph, a rule that disagrees with
autograd) is a property of the structure.

Tolerance (``tolerance``): the sum check has two tiers: the cheap bound (``factor`` 64), then,
for the sums that miss it, the rounding bound ``8 eps (sum_n |g_n| + |grad|) + 1000 eps max
|grad of the pass|``; a projected sum has its own bound (``projected``).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Optional, Tuple

import torch

from curvopt.core.plans import mark_sums_checked
from curvopt.guards.observer import Ending, LossEvent, ModuleEvent, PassGuard
from curvopt.guards.projected import PROJECTED_FACTOR, project
from curvopt.engine.reducer import reduce_in_chunks
from curvopt.core.passgrad import gradient
from curvopt.core.reductions import dense_gradient, probe_columns
from curvopt.engine.results import name_of
from curvopt.guards.tolerance import max_abs, mismatch, roundoff, stacked_mismatches
from curvopt.errors import UnsupportedModuleError

#: the spot check of materialised per-sample gradients reads ``_SPANS`` evenly spread runs of
#: ``_WIDTH`` entries of a parameter with more entries than that (``reductions.probe_columns``)
_SPANS, _WIDTH = 16, 256
#: entries of the per-sample gradients stacked for one sum of the spot check (a copy, bounded)
_STACK_ELEMENTS = 1 << 20


class _Total:
    """One parameter's sums of this pass: full ``sum_n g_n`` and/or projected through
    ``probes``, with the magnitude ``sum_r |b_r| |a_r|`` of the projected part."""

    __slots__ = ("uses", "full", "total", "probes", "projected", "magnitude")

    def __init__(self):
        self.uses: list = []  # (rule, call, name) of every call
        self.full: list = []  # those that gave a full sum
        self.total: Optional[torch.Tensor] = None
        self.probes: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        self.projected: Optional[torch.Tensor] = None
        self.magnitude: Optional[torch.Tensor] = None


class Checks(PassGuard):
    """The sum checks of one pass, and what they have seen so far: the walks of its losses
    (``loss``), the calls' precision and parameters (``module``), each call's ``sum_n g_n`` as
    the engine computed it (``total``), each parameter's gradient (``parameter``); at
    ``finish`` every parameter seen, every sum right, every curvature attribute written, and
    then the structures marked checked. They compare what the pass hands them and write no
    result."""

    def __init__(self):
        self.totals: Dict[int, _Total] = {}  # id(p): its sums of this pass
        self.param_grads: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}  # id(p): p, grad
        self.seen: set = set()  # ids of parameters whose module call was processed
        self.suspects: list = []  # (p, sum_n g_n, grad, sum_n |g_n|) beyond the cheap bound
        #: (p, projected sum_n g_n, projected grad, M, |u|_1 |v|_1), each [K], beyond 16 eps M
        self.projected_suspects: List[tuple] = []
        self.compute_eps: Dict[int, float] = {}  # id(p): roundoff of autocast calls using p
        self.structures: list = []  # keys of the extended losses' graphs (``walk.Walk``)
        #: whether the per-sample sums of a pass without first-order reductions (curvature
        #: only, or ``EKFAC``'s ``S``) are checked: on a structure's first pass
        self.sums = False

    def loss(self, event: LossEvent) -> None:
        self.note_walk(event.walk)

    def module(self, event: ModuleEvent) -> None:
        self.note_precision(event.record, event.params)
        seen = self.seen
        for _, p in event.params:
            seen.add(id(p))

    def total(self, p, use, total, projected) -> None:
        if projected is None:
            self.add_total(p, use, total)
        else:
            self.add_projected(p, use, *projected)

    def finish(self, ending: Ending) -> None:
        self.check_seen()
        self.check_materialised(ending.batch_grads)
        self.check_suspects()
        self.check_complete(ending.results, ending.attrs)
        self.mark_checked()

    def note_precision(self, record, params) -> None:
        """A call computed in a lower precision than its parameters (autocast) makes ``p.grad``
        that precise only: the sum checks use its roundoff."""
        for _, p in params:
            if record.dtype != p.dtype and p.is_floating_point():
                eps = torch.finfo(record.dtype).eps
                self.compute_eps[id(p)] = max(eps, self.compute_eps.get(id(p), 0.0))

    def note_walk(self, walk) -> None:
        """An extended loss's graph (``walk``) in this pass: its structure's sums are checked
        unless a pass of it had them checked."""
        self.structures.append(walk.key)
        self.sums = self.sums or walk.plan is None or not walk.plan.sums_checked

    def mark_checked(self) -> None:
        """The pass succeeded: its structures had their sums checked (if they were)."""
        if not self.sums:
            return
        for key in self.structures:
            if key is not None:
                mark_sums_checked(key)

    # ------------------------------------------------------------ sum_n g_n == p.grad
    def add_total(self, p, use, total) -> None:
        """Add one call's ``sum_n g_n`` (``use``: its ``(rule, call, name)``)."""
        entry = self.totals.setdefault(id(p), _Total())
        entry.uses.append(use)
        entry.full.append(use)
        entry.total = total if entry.total is None else entry.total + total
        self._check_if_due(p)

    def add_projected(self, p, use, probes, projected, magnitude) -> None:
        """Add one call's ``sum_n g_n`` seen through the pass's ``probes`` of ``p``
        (``engine.probes``) and its magnitude ``sum_r |b_r| |a_r|``
        (``LayerRule.projected_sum``)."""
        entry = self.totals.setdefault(id(p), _Total())
        entry.probes = probes
        entry.uses.append(use)
        if entry.projected is None:
            entry.projected, entry.magnitude = projected, magnitude
        else:
            entry.projected, entry.magnitude = (
                entry.projected + projected,
                entry.magnitude + magnitude,
            )
        self._check_if_due(p)

    def _check_if_due(self, p) -> None:
        if id(p) in self.param_grads:  # the parameter's hook ran first (dependent outputs)
            self.check_sum(p)

    def parameter_grad(self, p, grad, kept) -> None:
        """``p``'s whole gradient of this pass, checked against the sum of its per-sample
        gradients if those are in already; then ``kept`` (``passgrad.held``'s, no copy by
        autograd) in its place."""
        key = id(p)
        self.param_grads[key] = (p, grad)
        if key in self.totals:
            self.check_sum(p)
        self.param_grads[key] = (p, kept)

    #: the ``parameter`` event is :meth:`parameter_grad` itself (no call between)
    parameter = parameter_grad

    def has_grad(self, p) -> bool:
        """Whether ``p`` received its gradient of this pass."""
        return id(p) in self.param_grads

    def pass_grad(self, p) -> torch.Tensor:
        """``p``'s whole gradient of this pass (dense)."""
        return dense_gradient(gradient(self.param_grads[id(p)][1]))

    def check_sum(self, p) -> None:
        """``sum_n g_n == grad`` to the cheap bound, or else noted for the rounding bound."""
        grad = self.pass_grad(p)
        entry = self.totals.pop(id(p))
        if entry.projected is not None:
            self._check_projected(p, entry, grad)
            return
        if not mismatch(entry.total, grad, 64, self.compute_eps.get(id(p), 0.0)):
            return
        self.suspects.append((p, entry.total, grad, _abs_sum(p, entry.full)))

    def _check_projected(self, p, entry, grad) -> None:
        """The projected sums against ``uᵀ grad v`` to ``64 eps M``, else noted as wrong (a
        call that gave a full sum is projected too, with ``sum_n |g_n|`` for its ``M``); a
        gradient that is not finite has nothing to verify against. One read of the device."""
        u, v = entry.probes
        total, magnitude = entry.projected, entry.magnitude
        if entry.total is not None:
            total = total + project(entry.total, u, v)
            magnitude = magnitude + _norm_sum(p, entry.full)
        seen = project(grad, u, v)
        eps = roundoff(total, grad, floor=self.compute_eps.get(id(p), 0.0))
        gap = (total - seen.to(total.dtype)).abs_()
        within = (gap <= magnitude * (PROJECTED_FACTOR * eps)).all()  # NaN: not <=
        if not bool(within.logical_or_(seen.isfinite().all().logical_not_())):
            self.projected_suspects.append((p, total, seen))

    def check_materialised(self, batch_grads) -> None:
        """Spot check of ``sum_n g_n == grad`` on evenly spread entries of materialised
        per-sample gradients (``batch_grads``: ``id(p) -> (p, [N, *p.shape])``; every entry of
        a parameter with at most ``_SPANS * _WIDTH``). The parameters whose probed per-sample
        gradients share a shape, dtype and device are stacked (at most ``_STACK_ELEMENTS``
        entries a stack): one sum and one comparison a stack instead of one a parameter, all
        comparisons read at once (``tolerance.stacked_mismatches``). A parameter costs no
        Python call beyond its ``numel`` (and a large one's probes); a pass whose sums are all
        right, none beyond that at the end."""
        if not batch_grads:  # (none materialised: nothing to compare)
            return
        groups: Dict[tuple, list] = defaultdict(list)  # the per-sample gradients' shape,
        # dtype, device, the grad's dtype -> [(p, probed per-sample gradients, probed grad)]
        for key, (p, kept) in self.param_grads.items():
            if key not in batch_grads:
                continue
            batch, grad = batch_grads[key][1], gradient(kept)
            if grad.is_sparse:
                grad = dense_gradient(grad)
            if grad.numel() > _SPANS * _WIDTH:  # a large parameter: spread runs of entries
                batch = probe_columns(batch, _SPANS, _WIDTH)
                grad = probe_columns(grad, _SPANS, _WIDTH, rows=False)
            groups[batch.shape, batch.dtype, batch.device, grad.dtype].append((p, batch, grad))
        stacks, members = [], []  # (sums, grads, floors) of each stack; its entries and sums
        for group in groups.values():
            # (the floor: the roundoff of grad's own dtype, which the comparison casts away)
            floor = roundoff(group[0][2])
            if len(group) == 1:  # (the stack of one parameter: no size to split it by)
                parts: list = [group]
            else:
                per_stack = max(1, _STACK_ELEMENTS // group[0][1].numel())
                parts = [group[i : i + per_stack] for i in range(0, len(group), per_stack)]
            for part in parts:
                if len(part) == 1:  # (the pair itself: ``stacked_mismatches`` reads it whole)
                    sums = part[0][1].sum(0)
                    grads, totals = part[0][2], [sums]
                else:
                    sums = totals = torch.stack([batch for _, batch, _ in part]).sum(1)
                    grads = torch.stack([grad for _, _, grad in part])  # as the sums: one op
                if grads.dtype != sums.dtype:
                    grads = grads.to(sums.dtype)
                floors = [floor] * len(part)
                if self.compute_eps:  # autocast calls: their roundoff, where it is larger
                    floors = [max(floor, self.compute_eps.get(id(p), 0.0)) for p, *_ in part]
                stacks.append((sums, grads, floors))
                members.append((part, totals))
        found = stacked_mismatches(stacks, 64)
        if True not in found:  # every sum right (the common case)
            return
        found = iter(found)
        for part, totals in members:
            for (p, batch, grad), total in zip(part, totals):
                if next(found):
                    self.suspects.append((p, total, grad, batch.abs().sum(0)))

    def check_suspects(self) -> None:
        """Sums that missed the cheap bound, against the rounding bound (rounding inside each
        ``g_n`` when a parameter's gradient cancels to nearly zero); raises on a real gap.
        A projected sum beyond its bound (which covers cancellation: ``M`` sums norms) raises."""
        for p, total, seen in self.projected_suspects:
            _raise_wrong_sum(p, (total - seen.to(total.dtype)).abs_())
        if not self.suspects:
            return
        grads = (dense_gradient(gradient(g)) for _, g in self.param_grads.values())
        grads = [g for g in grads if g.numel()]
        largest = float(max_abs(*grads))
        for p, total, grad, magnitude in self.suspects:
            gap = (total - grad.to(total.dtype)).abs_()
            eps = roundoff(total, grad, floor=self.compute_eps.get(id(p), 0.0))
            tol = (magnitude + grad.abs()).mul_(8 * eps).add_(1000 * eps * largest)
            if bool((gap > tol).any()) or not bool(gap.isfinite().all()):
                _raise_wrong_sum(p, gap)

    def check_seen(self) -> None:
        """Every parameter with a gradient was seen through a call of its module (and the sums
        still open are checked)."""
        for key, (p, _) in self.param_grads.items():
            if key not in self.seen:
                raise UnsupportedModuleError(
                    f"curvopt: parameter {name_of(p)!r} received a gradient, but its module was "
                    "never called in this pass (a functional use, F.linear(h, layer.weight)), or "
                    "its forward ran while the curvopt optimizers of its model rested between "
                    "refreshes. Call the module, inside the collect block where an optimizer "
                    "rests; see docs/support.md#gradient-from-other-terms."
                )
        for key in list(self.totals):
            if key in self.param_grads:
                self.check_sum(self.param_grads[key][0])

    def check_complete(self, results, attrs) -> None:
        """Every parameter that received a gradient gets every requested curvature attribute."""
        if not attrs:  # first order only
            return
        for p, _ in self.param_grads.values():
            missing = results.missing(p, attrs)
            if missing:
                raise UnsupportedModuleError(
                    f"curvopt: parameter {name_of(p)!r} received "
                    f"a gradient but no {', '.join(sorted(missing))}: its gradient comes from "
                    "a term of the objective that is not an extended loss. Backpropagate only "
                    "sums of extended losses inside collect; see "
                    "docs/support.md#gradient-from-other-terms."
                )

    def clear(self) -> None:
        self.param_grads.clear()

    #: the ``release`` event is :meth:`clear` itself
    release = clear


def _raise_wrong_sum(p, gap) -> None:
    """The error for per-sample results of ``p`` that do not sum to its gradient (``gap``)."""
    if not bool(gap.isfinite().all()):  # mismatch lets these through only for a finite grad
        raise UnsupportedModuleError(
            f"curvopt: the per-sample results for parameter {name_of(p)!r} are not finite where "
            "its gradient is, so the rule of its module failed on this input. Report the "
            "module and input shapes as a curvopt bug (meanwhile: requires_grad=False for it)."
        )
    raise UnsupportedModuleError(
        f"curvopt: parameter {name_of(p)!r} receives gradient from outside the module "
        "that owns it (a tied head h @ emb.weight.T, or a penalty on it added to the loss). "
        "Use it only through its module, and pass an L2 penalty as the optimizer's "
        "weight_decay=; see docs/support.md#gradient-from-other-terms."
    )


def _norm_sum(p, uses) -> torch.Tensor:
    """``sum_n |g_n|`` (Euclidean) of ``p`` over the calls ``uses``, in chunks."""
    return sum(
        reduce_in_chunks(rule, call, name, p.shape, {"l2": True})["l2"].sqrt().sum()
        for rule, call, name in uses
    )


def _abs_sum(p, uses) -> torch.Tensor:
    """``sum_n |g_n|`` of ``p`` over the calls ``uses``, materialised in chunks."""
    return sum(
        reduce_in_chunks(rule, call, name, p.shape, {"abs_sum": True})["abs_sum"]
        for rule, call, name in uses
    )
