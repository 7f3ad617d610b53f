"""The autograd graph of one pass, walked once, and the plan of its structure, cached once.

:class:`Walk` reads the graph upstream of a root (an extended loss's input) depth-first, every
node's ``next_functions`` once, and collects what the pass needs from it: the extended-module
calls whose outputs it reaches (``calls``, in walk order), who consumes each node's outputs
(``consumers``, for the broadcast calls and the flow check), whether every backward op has a
``vmap`` batching rule, the parameters no extended module owns, the reentrant checkpoints
(re-run where asked, and walked on through the re-run), and the nodes themselves with their
edges (``edges``: the flow check's hooks, the accumulators the pass reaches, the checkpoint
stages, DiagHessian's and KFRA's traversals). What else is derived from the graph
(``indexes_inside``, the checkpoint regions) is read off these facts, not walked again; only
``between`` (the loss's own nodes, above the walk's root), ``reaches`` (the engine's graph
where no walk read it, ``BackwardPass._reaches``) and ``read_down`` (a loss's own graph at the
forward, before any backward: ``recognize``) read nodes the walk did not.

A fresh forward makes fresh nodes, so what holds for the graph's *structure* is kept apart:
:class:`Plan`, frozen, holds the structure facts (the calls in order, which of them are
broadcast, the verified row layouts with the calls found transposed, whether the per-sample
sums were checked), one per structure in one cache (``_PLANS``). Its key is the walk's
canonical form: each node's type and, for each node it passes gradient to, that node's
discovery number in the walk and the output it takes (so two graphs with the same node types
but other edges differ; the walk is deterministic, so the form gives the graph back), the calls
named by ``records.token`` (never by ``id``, which fresh models in a sweep reuse) and their output
shapes. A graph that picks entries by data (``logits[mask]``) has no key: what holds for one
batch need not for the next.
Each pass binds its plan to its own nodes and records (``Record.broadcast``,
``Record.transposed``).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, defaultdict
from typing import Dict, Hashable, List, Optional, Tuple

import torch
from torch.autograd.graph import GradientEdge

from curvopt.engine.broadcast import find
from curvopt.engine.checkpointing import Segment, adopt, segment_on
from curvopt.errors import UnsupportedModuleError
from curvopt.engine.records import records_on, token
from curvopt.engine.torch_internals import (
    ACCUMULATE_GRAD,
    COMPILED,
    DATA_INDEXING,
    NO_BATCHING_RULE,
    REENTRANT_CHECKPOINT,
)

#: the plans of the graph structures seen, most recent last
_PLANS: "OrderedDict[Hashable, Plan]" = OrderedDict()
_PLANS_SIZE = 256


@dataclasses.dataclass(frozen=True)
class Plan:
    """What holds for every graph of one structure: ``calls`` (``(token, output index, output
    shapes)`` in walk order), ``broadcasts`` (positions of the broadcast calls in ``calls``),
    ``layouts`` (``((root shape, elementwise), found)``, the row layouts ``rows`` verified:
    ``found`` is ``(row_dims, sample map, positions of the transposed calls)``, or None where no
    map passed), ``sums_checked`` (the per-sample sums of a curvature-only pass were
    checked on a pass of this structure, ``checks``)."""

    key: Hashable
    calls: Tuple = ()
    broadcasts: Tuple[int, ...] = ()
    layouts: Tuple = ()
    sums_checked: bool = False

    def layout(self, shape, elementwise: bool):
        """``(found,)`` for a verified layout of a root of ``shape`` (``found`` None where none
        passed), ``()`` where none was looked for."""
        for key, found in self.layouts:
            if key == (tuple(shape), elementwise):
                return (found,)
        return ()


def add_layout(walk: "Walk", shape, elementwise: bool, found) -> None:
    """Keep a row layout ``rows`` verified (or found none) in ``walk``'s plan."""
    entry = ((tuple(shape), elementwise), found)
    _remember(walk, lambda plan: {"layouts": (*plan.layouts, entry)})


def mark_sums_checked(key: Hashable) -> None:
    """A pass of the structure ``key`` (a ``Walk.key``) had its per-sample sums checked
    (``checks``)."""
    plan = _PLANS.get(key)
    _store(dataclasses.replace(plan or Plan(key), sums_checked=True))


def _remember(walk: "Walk", changes) -> None:
    """Replace ``walk``'s plan (as cached now) by one with ``changes(plan)``; no-op for a graph
    without a key."""
    if walk.plan is None:
        return
    plan = _PLANS.get(walk.plan.key, walk.plan)
    walk.plan = dataclasses.replace(plan, **changes(plan))
    _store(walk.plan)


def _store(plan: Plan) -> None:
    _PLANS[plan.key] = plan
    _PLANS.move_to_end(plan.key)
    if len(_PLANS) > _PLANS_SIZE:
        _PLANS.popitem(last=False)


class Walk:
    """The graph upstream of ``root`` (a tensor or an autograd node), walked once.

    ``calls[record] = [(output index, edge)]``; ``consumers[(node, nr)] = [(consumer, j)]``: the
    nodes that take output ``nr`` of ``node`` as their ``j``-th input (``j`` None: a re-run
    checkpoint taking its re-run output); ``edges[node]``: ``node.next_functions`` of every node
    walked past; ``batchable``: columns may be propagated batched; ``foreign``: parameters it
    reaches that no extended module owns; ``reentrant``: a checkpoint it could not walk through;
    ``key``: the structure's key (None: indexes by data); ``plan``: the structure's plan.

    A reentrant checkpoint is walked through where curvopt re-ran its segment, and re-run on
    the way where ``recompute`` is a list (the new ``checkpointing.Segment``s are appended to
    it, for the caller to release). ``within`` (another walk's ``edges``) walks a part of a
    graph walked already, reading no node again. A ``torch.compile``d graph's node (one fused
    op) raises where ``recompute`` is a list (curvature); a first-order walk passes it.
    """

    def __init__(self, root, recompute: Optional[list] = None, within: Optional[dict] = None):
        start = root.grad_fn if isinstance(root, torch.Tensor) else root
        self.root = start
        self.calls: Dict[object, List[Tuple[int, GradientEdge]]] = defaultdict(list)
        #: ``(node, nr) -> [(consumer, j)]``
        self.consumers: Dict[Tuple[object, int], list] = defaultdict(list)
        self.edges: Dict[object, tuple] = {}
        self.head: Dict[object, tuple] = {}  # ``between``'s nodes (the loss's own)
        self.batchable = True
        self.foreign: list = []
        self.reentrant = False
        self.checkpoints: list = []  # the re-run checkpoints walked through
        self._users = None
        self._walk(start, recompute, within)

    def _walk(self, start, recompute, within) -> None:
        calls, consumers, edges = self.calls, self.consumers, self.edges
        # the key, flat: per node walked, its type, its number of edges, each edge as the
        # discovery number of its node (-1 for none) and the output it takes, its calls
        key, stops, found = [], set(), {start: 0}
        stack, by_data = [start], False
        while stack:
            node = stack.pop()
            if node is None or node in edges or node in stops:
                continue
            kind = type(node).__name__
            if kind in COMPILED and recompute is not None:  # curvature (first order walks on)
                raise UnsupportedModuleError(
                    "curvopt cannot propagate curvature through a graph compiled by "
                    "torch.compile (its backward is one fused op); compute curvature on the "
                    "uncompiled model (for a compiled module m, use m._orig_mod) — first-order "
                    "quantities do work with torch.compile"
                )
            if kind == REENTRANT_CHECKPOINT:
                segment = segment_on(node)
                if segment is None and recompute is not None:
                    segment = Segment(node)
                    recompute.append(segment)
                if segment is None:
                    self.reentrant = True
                    stops.add(node)
                    key += (kind, 0, ())
                    continue  # nothing upstream can be reached by columns
                edges[node] = node.next_functions
                nexts = [
                    (t.grad_fn, t.output_nr)
                    for t in segment.outputs
                    if isinstance(t, torch.Tensor) and t.grad_fn is not None
                ]
                key += (kind, len(nexts))
                if nexts:
                    self.checkpoints.append(node)
                for fn, nr in nexts:
                    # the checkpoint node takes the re-run output (no input index of its own)
                    consumers[(fn, nr)].append((node, None))
                    stack.append(fn)
                    key += (found.setdefault(fn, len(found)), nr)
                key.append(())
                continue
            nexts = None if within is None else within.get(node)
            if nexts is None:
                nexts = node.next_functions
            edges[node] = nexts
            if kind == ACCUMULATE_GRAD:
                leaf = node.variable
                if isinstance(leaf, torch.nn.Parameter) and not getattr(
                    leaf, "_curvopt_checked", 0
                ):
                    self.foreign.append(leaf)
            elif kind in NO_BATCHING_RULE:
                self.batchable = False
            elif kind in DATA_INDEXING:
                by_data = True
            key += (kind, len(nexts))
            for j, (fn, nr) in enumerate(nexts):
                if fn is None:
                    key += (-1, nr)
                else:
                    consumers[(fn, nr)].append((node, j))
                    stack.append(fn)
                    key += (found.setdefault(fn, len(found)), nr)
            entries = records_on(node)
            if entries:
                key.append(tuple((token(r.module), i, r.out_shapes) for r, i, _ in entries))
                for record, index, output_nr in entries:
                    calls[record].append((index, GradientEdge(node, output_nr)))
            else:
                key.append(())
        self.by_data = by_data
        if self.checkpoints:
            adopt(edges)
        broadcasts = self._broadcasts()
        if by_data:
            self.key, self.plan = None, None
            return
        self.key = (tuple(key), broadcasts)
        self.plan = _PLANS.get(self.key)
        if self.plan is None:
            described = tuple(
                (token(r.module), index, r.out_shapes)
                for r, edges in calls.items()
                for index, _ in edges
            )
            self.plan = Plan(self.key, described, broadcasts)
            _remember(self, lambda plan: {})
        else:
            _PLANS.move_to_end(self.key)

    def _broadcasts(self) -> Tuple[int, ...]:
        """Bind the broadcast calls (``broadcast.find``) on this pass's records; their positions."""
        found = []
        for position, (record, edges) in enumerate(self.calls.items()):
            if len(record.out_shapes) == 1:
                ((index, edge),) = edges
                broadcast = find(edge.node, edge.output_nr, record.out_shapes[0], self.consumers)
                # another collection's pass of this backward found it already: the same object
                kept = record.broadcast
                if broadcast is None or kept is None or kept.edge != broadcast.edge:
                    record.broadcast = broadcast
                if record.broadcast is not None:
                    self.calls[record] = [(index, record.broadcast.edge)]
                    found.append(position)
        return tuple(found)

    # ------------------------------------------------------------ read off the walk
    @property
    def users(self) -> Dict[object, list]:
        """``users[node]``: the nodes of the walk that take an output of ``node``."""
        if self._users is None:
            users = defaultdict(list)
            for (node, _), consumers in self.consumers.items():
                users[node].extend(c for c, _ in consumers)
            self._users = users
        return self._users

    @property
    def indexes_inside(self) -> bool:
        """Whether an op that picks entries by data lies upstream of a module call's output,
        i.e. inside the model, where it may mix samples (``h[perm]``), rather than between the
        model and the loss (``logits[mask]``): downstream of such an op, a call's output."""
        if not self.by_data:
            return False
        outputs = {edge.node for edges in self.calls.values() for _, edge in edges}
        users = self.users
        stack = [n for n in self.edges if type(n).__name__ in DATA_INDEXING]
        seen = set()
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            if node in outputs:
                return True
            stack.extend(users.get(node, ()))
        return False

    def next_of(self, node) -> tuple:
        """``node.next_functions``, as read by the walk."""
        nexts = self.edges.get(node)
        if nexts is None:
            nexts = self.head.get(node)
        return node.next_functions if nexts is None else nexts

    def next_nodes(self, node) -> list:
        """The nodes ``node`` passes gradient to as the walk went on: through a live segment's
        re-run for its checkpoint's node (``None`` entries possible)."""
        segment = segment_on(node)
        if segment is None:
            return [fn for fn, _ in self.next_of(node)]
        return [t.grad_fn for t in segment.outputs if isinstance(t, torch.Tensor)]

    def between(self, top) -> list:
        """The nodes on paths from ``top`` (downstream of the root: the loss's output node) down
        to the root, the root excluded; paths into the walk elsewhere do not count (they enter
        the model's graph elsewhere). The nodes read are added to ``head``."""
        bottom = self.root
        if top is None or bottom is None:
            return []
        reaches = {bottom: True}
        inside, head = self.edges, self.head
        stack = [(top, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                reaches[node] = any(reaches.get(fn, False) for fn, _ in head[node])
            elif node not in reaches:
                reaches[node] = False
                if node not in inside:
                    nexts = head[node] = node.next_functions
                    stack.append((node, True))
                    stack.extend((fn, False) for fn, _ in nexts if fn is not None)
        del reaches[bottom]
        return [node for node, reached in reaches.items() if reached]


def reaches(start, node, done: dict) -> bool:
    """Whether ``node`` lies upstream of ``start``, walking on from ``done`` (``node ->
    next_functions`` of every node whose whole upstream was walked already, updated here)."""
    if node in done:
        return True
    stack = [start]
    while stack:
        current = stack.pop()
        if current is None or current in done:
            continue
        nexts = done[current] = current.next_functions
        stack.extend(fn for fn, _ in nexts)
    return node in done


def read_down(root, expand) -> Tuple[Dict[object, tuple], Dict[object, int]]:
    """A loss's own graph, read from its output node ``root`` before any backward
    (``recognize``): ``expand(node, state, inputs)`` (``inputs``: the nodes ``node`` passes
    gradient to, None for a constant) gives the state to walk ``inputs`` with, or None to stop
    at ``node`` (``root`` is walked with state None). Returns the inputs of every node expanded
    and how many expanded nodes feed each node."""
    inputs: Dict[object, tuple] = {}
    consumers: Dict[object, int] = defaultdict(int)
    stack, seen = [(root, None)], set()
    while stack:
        node, state = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        nexts = tuple(fn for fn, _ in node.next_functions)
        below = expand(node, state, nexts)
        if below is None:
            continue
        inputs[node] = nexts
        for fn in nexts:
            if fn is not None:
                consumers[fn] += 1
                stack.append((fn, below))
    return inputs, dict(consumers)
