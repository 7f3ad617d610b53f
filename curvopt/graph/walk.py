"""The autograd graph of one pass upstream of a root, walked once (``search.search``).

:class:`Walk` reads the graph upstream of a root (an extended loss's input) depth-first, every
node's edges once, and collects what the pass needs from it: the extended-module calls whose
outputs it reaches (``calls``, in walk order), who consumes each node's outputs
(``consumers``, for the broadcast calls and the flow check), whether every backward op has a
``vmap`` batching rule, the parameters no extended module owns, the reentrant checkpoints
(re-run where asked, and walked on through the re-run), and the nodes themselves with their
edges (``edges``: the flow check's hooks, the accumulators the pass reaches, the checkpoint
stages, DiagHessian's and KFRA's traversals). What else is derived from the graph
(``indexes_inside``, the checkpoint regions) is read off these facts, not walked again; only
``between`` (the loss's own nodes, above the walk's root) reads nodes the walk did not.

The special cases join only where the walk meets them: the broadcast calls are looked for only
where it met a broadcasting op, the checkpoint stages only where it met a reentrant checkpoint.

The structure's key is the walk's canonical form: each node's type and, for each node it
passes gradient to, that node's discovery number in the walk and the output it takes (so two
graphs with the same node types but other edges differ; the walk is deterministic, so the form
gives the graph back), the calls named by ``records.token`` (never by ``id``, which fresh
models in a sweep reuse) and their output shapes; its plan is ``core.plans.plan_of(key)``. A
graph that picks entries by data (``logits[mask]``) has no key: what holds for one batch need
not for the next. Each pass binds its plan to its own nodes and records (``Record.broadcast``,
``Record.transposed``).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Optional, Tuple

import torch
from torch.autograd.graph import GradientEdge

from curvopt.graph.broadcast import find
from curvopt.graph.checkpointing import Segment, Segments
from curvopt.core.plans import Plan, plan_of
from curvopt.graph.search import edges_of, search, upstream
from curvopt.core.extended import is_extended_parameter
from curvopt.core.records import records_on, token
from curvopt.autograd.torch_internals import (
    ACCUMULATE_GRAD,
    BROADCASTING_OPS,
    COMPILED,
    DATA_INDEXING,
    NO_BATCHING_RULE,
    REENTRANT_CHECKPOINT,
)
from curvopt.errors import UnsupportedModuleError

_COMPILED = (
    "curvopt cannot propagate curvature through a graph compiled by torch.compile (its backward "
    "is one fused op). Extend the compiled model, m = curvopt.extend(torch.compile(model)), "
    "which runs eagerly where curvature is collected, or compute curvature on the uncompiled "
    "m._orig_mod; see docs/conventions.md#compiled-models."
)


class Walk:
    """The graph upstream of ``root`` (a tensor or an autograd node), walked once.

    ``calls[record] = [(output index, edge)]``; ``consumers[(node, nr)] = [(consumer, j)]``: the
    nodes that take output ``nr`` of ``node`` as their ``j``-th input (``j`` None: a re-run
    checkpoint taking its re-run output); ``edges[node]``: the edges (``search.edges_of``)
    of every node walked past; ``batchable``: columns may be propagated batched; ``foreign``:
    parameters it reaches that no extended module owns; ``accumulators``: the
    ``AccumulateGrad`` node of every leaf it reaches, by ``id``; ``extended_leaves``: those of
    the extended parameters (the flow check's); ``reentrant``: a checkpoint it could not walk
    through; ``numbers``: each node's discovery number (the key's name for it), in that order;
    ``key``: the structure's key (None: indexes by data); ``plan``: the structure's plan.

    A reentrant checkpoint is walked through where curvopt re-ran its segment, and re-run on
    the way where ``recompute`` is a list (the new ``checkpointing.Segment``s are appended to
    it, for the caller to release). ``within`` (another walk) walks a part of a graph walked
    already, reading no node again; it is ``segmented`` where that walk is (its columns may
    cross the same live segments). A ``torch.compile``d graph's node (one fused
    op) raises where ``recompute`` is a list (curvature); a first-order walk passes it.
    """

    def __init__(self, root, recompute: Optional[list] = None, within: Optional[dict] = None):
        start = root.grad_fn if isinstance(root, torch.Tensor) else root
        self.root = start
        self.calls: Dict[object, List[Tuple[int, GradientEdge]]] = defaultdict(list)
        self.edges: Dict[object, tuple] = {}
        #: a re-run checkpoint's node -> the re-run outputs it takes, ``(node, nr)`` each
        self.reruns: Dict[object, list] = {}
        self.head: Dict[object, tuple] = {}  # ``between``'s nodes (the loss's own)
        self.batchable = True
        self.foreign: list = []
        self.accumulators: Dict[int, object] = {}  # id(leaf): its ``AccumulateGrad`` node
        self.extended_leaves: list = []  # the ``AccumulateGrad`` nodes of extended parameters
        self.reentrant = False
        self.checkpoints: list = []  # the re-run checkpoints walked through
        # a checkpoint curvopt re-ran was met, here or by ``within`` (``checkpointing``)
        self.segmented = within is not None and within.segmented
        #: the segments re-run by this walk or ``within``, shared with it (``checkpointing``)
        self.segments: Optional[Segments] = None if within is None else within.segments
        self.broadcasting = False  # a broadcasting op was met (``broadcast``)
        self.by_data = False  # an op that picks entries by data was met
        #: ``(root node, output nr, edges asked) -> max-pool stages or None`` (``pooling``)
        self.pool_stages: dict = {}
        self._consumers: Optional[Dict[Tuple[object, int], list]] = None
        self._users = None
        self._walk(start, recompute, within)

    def _walk(self, start, recompute, within) -> None:
        # the key, flat: per node walked, its type (a string), its calls (a tuple), each edge
        # as the discovery number of its node (-1 for none) and the output it takes (two
        # ints: the next string ends a node's edges, so their count needs no entry)
        key, found = [], {start: 0}
        calls, edges = self.calls, self.edges

        def expand(node) -> list:
            nonlocal key
            kind = type(node).__name__
            if kind in COMPILED and recompute is not None:  # curvature (first order walks on)
                raise UnsupportedModuleError(_COMPILED)
            if kind == REENTRANT_CHECKPOINT:
                return self._checkpoint(node, kind, recompute, key, found)
            nexts = None if within is None else within.edges.get(node)
            if nexts is None:
                nexts = edges_of(node)
            edges[node] = nexts
            if kind == ACCUMULATE_GRAD:
                leaf = node.variable
                self.accumulators[id(leaf)] = node
                if is_extended_parameter(leaf):
                    self.extended_leaves.append(node)
                elif isinstance(leaf, torch.nn.Parameter):
                    self.foreign.append(leaf)
            elif kind in NO_BATCHING_RULE:
                self.batchable = False
            elif kind in DATA_INDEXING:
                self.by_data = True
            elif kind in BROADCASTING_OPS:
                self.broadcasting = True
            described = ()  # (built in the loop: a generator costs a call per entry)
            for record, index, output_nr in records_on(node):
                described += ((token(record.module), index, record.out_shapes),)
                calls[record].append((index, GradientEdge(node, output_nr)))
            key += (kind, described)
            if not nexts:  # (a leaf's accumulator)
                return nexts
            for fn, nr in nexts:  # (no call but a new node's count: ``in`` and ``[]``)
                if fn is None:
                    key += (-1, nr)
                elif fn in found:
                    key += (found[fn], nr)
                else:
                    number = found[fn] = len(found)
                    key += (number, nr)
            return [fn for fn, _ in nexts]  # (``search`` skips the None of a constant)

        search([start], expand)
        self.numbers = found
        if self.checkpoints:
            self.segments.adopt(self.edges)
        broadcasts = self._broadcasts() if self.broadcasting else ()
        if self.by_data:
            self.key, self.plan = None, None
            return
        self.key = (tuple(key), broadcasts)
        self.plan = plan_of(self.key, self._described)

    def _checkpoint(self, node, kind, recompute, key, found) -> list:
        """A reentrant checkpoint's node: walked on through its re-run (made here where asked),
        else a stop (nothing upstream can be reached by columns)."""
        segment = None if self.segments is None else self.segments.on(node)
        if segment is None and recompute is not None:
            if self.segments is None:
                self.segments = Segments()
            segment = Segment(node, self.segments)
            recompute.append(segment)
        if segment is None:
            self.reentrant = True
            key += (kind, ())
            return []
        self.segmented = True
        self.edges[node] = edges_of(node)
        nexts = [
            (t.grad_fn, t.output_nr)
            for t in segment.outputs
            if isinstance(t, torch.Tensor) and t.grad_fn is not None
        ]
        key += (kind, ())
        if nexts:
            self.checkpoints.append(node)
        self.reruns[node] = nexts
        for fn, nr in nexts:
            key += (found.setdefault(fn, len(found)), nr)
        return [fn for fn, _ in nexts]

    def _described(self) -> Plan:
        """The plan of a structure seen for the first time."""
        described = tuple(
            (token(r.module), index, r.out_shapes)
            for r, edges in self.calls.items()
            for index, _ in edges
        )
        return Plan(self.key, described, self.key[1])

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
    def parameter_site(self, p, samples: int):
        """The ``broadcast.Broadcast`` where leaf ``p``'s per-sample gradients can be read: its
        only use in the graph is an add or an expand (through shape-only ops) that broadcasts
        it along the leading dim alone, of size ``samples``; or None. Along that dim alone:
        ``p`` has the per-sample shape then, so the dim that its values repeat along is the
        batch (a bias added over ``[L, N, E]`` with ``L == N``, as inside attention, would
        otherwise pass for one broadcast over samples)."""
        node = self.accumulators.get(id(p)) if self.broadcasting else None
        site = None if node is None else find(node, 0, p.shape, self.consumers)
        if site is None or site.samples != samples or site.reduced:
            return None
        return site

    @property
    def consumers(self) -> Dict[Tuple[object, int], list]:
        """``consumers[(node, nr)] = [(consumer, j)]``: the nodes of the walk that take output
        ``nr`` of ``node`` as their ``j``-th input (``j`` None: a re-run checkpoint taking its
        re-run output), in the walk's order; read off its edges when first asked (a broadcast,
        a parameter's site, the flow check's region)."""
        if self._consumers is None:
            consumers: Dict[Tuple[object, int], list] = defaultdict(list)
            for node, nexts in self.edges.items():
                rerun = self.reruns.get(node)
                if rerun is not None:
                    for fn, nr in rerun:
                        consumers[(fn, nr)].append((node, None))
                    continue
                for j, (fn, nr) in enumerate(nexts):
                    if fn is not None:
                        consumers[(fn, nr)].append((node, j))
            self._consumers = consumers
        return self._consumers

    @property
    def users(self) -> Dict[object, list]:
        """``users[node]``: the nodes of the walk that take an output of ``node``."""
        if self._users is None:
            users, reruns = defaultdict(list), self.reruns
            for node, nexts in self.edges.items():
                for fn, _ in reruns.get(node, nexts) if reruns else nexts:
                    if fn is not None:
                        users[fn].append(node)
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
        starts = [n for n in self.edges if type(n).__name__ in DATA_INDEXING]
        return any(n in outputs for n in search(starts, lambda n: users.get(n, ())))

    def next_of(self, node) -> tuple:
        """The edges of ``node`` (``search.edges_of``), as read by the walk."""
        nexts = self.edges.get(node)
        if nexts is None:
            nexts = self.head.get(node)
        return edges_of(node) if nexts is None else nexts

    def segment_of(self, node):
        """The live ``checkpointing.Segment`` of a checkpoint's node the walk re-ran, or None."""
        return self.segments.on(node) if self.segmented else None

    def next_nodes(self, node) -> list:
        """The nodes ``node`` passes gradient to as the walk went on: through a live segment's
        re-run for its checkpoint's node (``None`` entries possible)."""
        segment = self.segment_of(node)
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
        inside, head = self.edges, self.head

        def down(node) -> list:
            if node is bottom or node in inside:
                return []
            head[node] = edges_of(node)
            return upstream(node)

        read = search([top], down)
        feeds = defaultdict(list)  # node -> the nodes read that pass gradient to it
        for node, nexts in read.items():
            for fn in nexts:
                feeds[fn].append(node)
        reaching = search([bottom], lambda n: feeds.get(n, ()))
        return [node for node in read if node in reaching and node is not bottom]
