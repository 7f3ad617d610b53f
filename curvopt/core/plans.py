"""What holds for every graph of one structure, kept across passes: the plan cache.

A fresh forward makes fresh autograd nodes, so what holds for the graph's *structure* is kept
apart from any graph: :class:`Plan`, frozen, holds the structure facts (the calls in order,
which of them are broadcast, the verified row layouts with the calls found transposed, whether
the per-sample sums were checked, the site readings that matched, whether the loss's exact
columns are compressed at a language model's head, the nodes the flow check watches for each
set of extended parameters), one per structure, keyed by the walk's
canonical form (``graph.walk.Walk.key``), the most recent 256 kept. The cache is the
context's (:data:`PLANS`, a context variable: a thread's, or an asyncio task's where it made
one), not the process's: a pass reads and extends the plans of the context its loss hook runs
in, which on the CPU is the thread that called ``backward``. The functions that add a
fact take the walk whose ``plan`` they extend (and replace). (What a pass finds of its own
graph, the stages across re-run checkpoints or max pooling, is its walk's:
``Walk.segments``, ``Walk.pool_stages``.)
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections import OrderedDict
from typing import Callable, Hashable, Optional, Tuple

#: the plans of the graph structures seen in this context, most recent last (made at its first
#: pass, :func:`plan_cache`)
PLANS: "contextvars.ContextVar[Optional[OrderedDict]]" = contextvars.ContextVar(
    "curvopt_plans", default=None
)
_PLANS_SIZE = 256


@dataclasses.dataclass(frozen=True)
class Plan:
    """What holds for every graph of one structure: ``calls`` (``(token, output index, output
    shapes)`` in walk order), ``broadcasts`` (positions of the broadcast calls in ``calls``),
    ``layouts`` (``((root shape, elementwise), found)``, the row layouts ``rows`` verified:
    ``found`` is ``(row_dims, sample map, positions of the transposed calls, the
    ``layouts.RowLayout``)``, or None where no map passed), ``sums_checked`` (the per-sample sums
    of a curvature-only pass were checked on a pass of this structure, ``checks``), ``sites``
    (``((module token, parameter name), matched)``: whether a raw parameter's per-sample
    gradients read at its site matched its module's rule, ``sites``), ``cuts`` (``((loss input
    shape, exact columns per row, diagonals asked), found)``: whether ``compress.find_cut`` found
    a head to compress the exact columns at, ``curvature.choose``; a cut found is bound and checked
    again on every pass, none found is not looked for again), ``regions`` (``(extended leaves,
    region)``: the nodes the flow check watches, ``guards.flow``, as the walk's discovery
    numbers, for the numbers of the extended parameters' ``AccumulateGrad`` nodes, which the
    key does not fix)."""

    key: Hashable
    calls: Tuple = ()
    broadcasts: Tuple[int, ...] = ()
    layouts: Tuple = ()
    sums_checked: bool = False
    sites: Tuple = ()
    cuts: Tuple = ()
    regions: Tuple = ()

    def site(self, key) -> Optional[bool]:
        """Whether the raw parameter ``key`` (``(module token, parameter name)``) read at its
        site matched its module's rule on this structure; ``None`` where not checked yet."""
        return dict(self.sites).get(key)

    def region(self, leaves) -> Optional[Tuple[int, ...]]:
        """The flow check's region where the extended parameters' ``AccumulateGrad`` nodes are
        the walk's nodes ``leaves`` (discovery numbers); ``None`` where not found yet."""
        return dict(self.regions).get(leaves)


def plan_cache() -> "OrderedDict[Hashable, Plan]":
    """This context's plans by structure key (:data:`PLANS`), made empty on its first use."""
    plans = PLANS.get()
    if plans is None:
        plans = OrderedDict()
        PLANS.set(plans)
    return plans


def plan_of(key: Hashable, make: Callable[[], Plan]) -> Plan:
    """The cached plan of the structure ``key`` (made by ``make`` on its first pass)."""
    plans = plan_cache()
    plan = plans.get(key)
    if plan is None:
        plan = make()
        _store(plan)
    else:
        plans.move_to_end(key)
    return plan


def add_layout(walk, shape, elementwise: bool, found) -> None:
    """Keep a row layout ``rows`` verified (or found none) in ``walk``'s plan."""
    entry = ((tuple(shape), elementwise), found)
    if walk.plan is None:
        return
    plan = plan_cache().get(walk.plan.key, walk.plan)
    walk.plan = dataclasses.replace(plan, layouts=(*plan.layouts, entry))
    _store(walk.plan)


def add_site(walk, param_key, matched: bool) -> None:
    """Keep in ``walk``'s plan whether the site reading of the parameter ``param_key`` matched
    its module's rule (``sites``)."""
    plan = plan_cache().get(walk.plan.key, walk.plan)
    walk.plan = dataclasses.replace(plan, sites=(*plan.sites, (param_key, matched)))
    _store(walk.plan)


def add_cut(walk, key, found: bool) -> None:
    """Keep in ``walk``'s plan whether a cut was found for the columns described by ``key``
    (``curvature.choose``)."""
    if walk.plan is None:
        return
    plan = plan_cache().get(walk.plan.key, walk.plan)
    walk.plan = dataclasses.replace(plan, cuts=(*plan.cuts, (key, found)))
    _store(walk.plan)


def add_region(walk, leaves, region) -> None:
    """Keep in ``walk``'s plan the flow check's ``region`` for the extended leaves ``leaves``
    (both as discovery numbers, :meth:`Plan.region`)."""
    if walk.plan is None:
        return
    plan = plan_cache().get(walk.plan.key, walk.plan)
    walk.plan = dataclasses.replace(plan, regions=(*plan.regions, (leaves, region)))
    _store(walk.plan)


def mark_sums_checked(key: Hashable) -> None:
    """A pass of the structure ``key`` (a ``Walk.key``) had its per-sample sums checked
    (``checks``)."""
    plan = plan_cache().get(key)
    _store(dataclasses.replace(plan or Plan(key), sums_checked=True))


def _store(plan: Plan) -> None:
    plans = plan_cache()
    plans[plan.key] = plan
    plans.move_to_end(plan.key)
    if len(plans) > _PLANS_SIZE:
        plans.popitem(last=False)
