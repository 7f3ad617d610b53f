"""Reading the autograd graph, and what is kept of it: the one graph search, and the plan caches.

:func:`search` is the one walk over autograd nodes: every reader of the graph (the pass's
``walk.Walk``, the checkpoint stages and releases, the flow check's region, DiagHessian's and
KFRA's traversals, a returned loss's graph read at the forward) is a call of it with its own
``expand``. :func:`edges_of` is the one read of a node's edges (its ``next_functions``).

A fresh forward makes fresh nodes, so what holds for the graph's *structure* is kept apart:
:class:`Plan`, frozen, holds the structure facts (the calls in order, which of them are
broadcast, the verified row layouts with the calls found transposed, whether the per-sample
sums were checked, whether the loss's exact columns are compressed at a language model's head),
one per structure, in ``_PLANS``, keyed by the walk's canonical form
(``walk.Walk.key``). (The stages of a pass, across re-run checkpoints or max pooling, are its
walk's own: ``walk.Walk.segments``, ``walk.Walk.pool_stages``.)
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, defaultdict
from typing import Callable, Dict, Hashable, Iterable, Tuple

#: the plans of the graph structures seen, most recent last
_PLANS: "OrderedDict[Hashable, Plan]" = OrderedDict()
_PLANS_SIZE = 256


def edges_of(node) -> tuple:
    """The edges of ``node``: ``(node it passes gradient to or None, output nr)`` pairs."""
    return node.next_functions


def search(starts: Iterable, expand: Callable[[object], Iterable], seen=None) -> dict:
    """Depth-first from ``starts``, each node once (``None`` skipped): ``expand(node)`` gives the
    nodes to go on to (empty: stop there). Returns ``{node: expand(node)}`` in visiting order
    (``seen``: such a dict of nodes not to visit again, updated in place)."""
    seen = {} if seen is None else seen
    stack = list(starts)
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen[node] = nexts = expand(node)
        stack.extend(nexts)
    return seen


def upstream(node) -> list:
    """The nodes ``node`` passes gradient to (``None`` for constants)."""
    return [fn for fn, _ in edges_of(node)]


def reaches(start, node, done: dict) -> bool:
    """Whether ``node`` lies upstream of ``start``, walking on from ``done`` (the nodes whose
    whole upstream was walked already, updated here)."""
    if node in done:
        return True
    search([start], upstream, done)
    return node in done


def read_down(root, expand) -> Tuple[Dict[object, tuple], Dict[object, int]]:
    """A loss's own graph, read from its output node ``root`` before any backward
    (``recognize``): ``expand(node, state, inputs)`` (``inputs``: the nodes ``node`` passes
    gradient to, None for a constant) gives the state to walk ``inputs`` with, or None to stop
    at ``node`` (``root`` is walked with state None). Returns the inputs of every node expanded
    and how many expanded nodes feed each node."""
    inputs: Dict[object, tuple] = {}
    consumers: Dict[object, int] = defaultdict(int)
    states = {root: None}  # the state a node is walked with: that of its latest push

    def down(node):
        nexts = tuple(upstream(node))
        below = expand(node, states[node], nexts)
        if below is None:
            return ()
        inputs[node] = nexts
        for fn in nexts:
            if fn is not None:
                consumers[fn] += 1
                states[fn] = below
        return nexts

    search([root], down)
    return inputs, dict(consumers)


# ------------------------------------------------------------------------ the plan caches


@dataclasses.dataclass(frozen=True)
class Plan:
    """What holds for every graph of one structure: ``calls`` (``(token, output index, output
    shapes)`` in walk order), ``broadcasts`` (positions of the broadcast calls in ``calls``),
    ``layouts`` (``((root shape, elementwise), found)``, the row layouts ``rows`` verified:
    ``found`` is ``(row_dims, sample map, positions of the transposed calls, the
    ``rows.RowLayout``)``, or None where no map passed), ``sums_checked`` (the per-sample sums
    of a curvature-only pass were checked on a pass of this structure, ``checks``), ``sites``
    (``((module token, parameter name), matched)``: whether a raw parameter's per-sample
    gradients read at its site matched its module's rule, ``sites``), ``cuts`` (``((loss input
    shape, exact columns per row, diagonals asked), found)``: whether ``compress.find_cut`` found
    a head to compress the exact columns at, ``strategies``; a cut found is bound and checked
    again on every pass, none found is not looked for again)."""

    key: Hashable
    calls: Tuple = ()
    broadcasts: Tuple[int, ...] = ()
    layouts: Tuple = ()
    sums_checked: bool = False
    sites: Tuple = ()
    cuts: Tuple = ()


def plan_of(key: Hashable, make: Callable[[], Plan]) -> Plan:
    """The cached plan of the structure ``key`` (made by ``make`` on its first pass)."""
    plan = _PLANS.get(key)
    if plan is None:
        plan = make()
        _store(plan)
    else:
        _PLANS.move_to_end(key)
    return plan


def add_layout(walk, shape, elementwise: bool, found) -> None:
    """Keep a row layout ``rows`` verified (or found none) in ``walk``'s plan."""
    entry = ((tuple(shape), elementwise), found)
    if walk.plan is None:
        return
    plan = _PLANS.get(walk.plan.key, walk.plan)
    walk.plan = dataclasses.replace(plan, layouts=(*plan.layouts, entry))
    _store(walk.plan)


def add_site(walk, param_key, matched: bool) -> None:
    """Keep in ``walk``'s plan whether the site reading of the parameter ``param_key`` matched
    its module's rule (``sites``)."""
    plan = _PLANS.get(walk.plan.key, walk.plan)
    walk.plan = dataclasses.replace(plan, sites=(*plan.sites, (param_key, matched)))
    _store(walk.plan)


def add_cut(walk, key, found: bool) -> None:
    """Keep in ``walk``'s plan whether a cut was found for the columns described by ``key``
    (``strategies``)."""
    if walk.plan is None:
        return
    plan = _PLANS.get(walk.plan.key, walk.plan)
    walk.plan = dataclasses.replace(plan, cuts=(*plan.cuts, (key, found)))
    _store(walk.plan)


def mark_sums_checked(key: Hashable) -> None:
    """A pass of the structure ``key`` (a ``Walk.key``) had its per-sample sums checked
    (``checks``)."""
    plan = _PLANS.get(key)
    _store(dataclasses.replace(plan or Plan(key), sums_checked=True))


def _store(plan: Plan) -> None:
    _PLANS[plan.key] = plan
    _PLANS.move_to_end(plan.key)
    if len(_PLANS) > _PLANS_SIZE:
        _PLANS.popitem(last=False)
