"""Curvature columns through reentrant activation checkpoints.

``torch.utils.checkpoint(fn, *args, use_reentrant=True)`` leaves one autograd node whose
backward re-runs ``fn`` and calls ``backward()`` on the result: ``torch.autograd.grad``, and so
curvopt's columns, cannot pass it. For curvature, curvopt re-runs each such segment itself when
the loss hook walks the graph (:class:`Segment`, ``torch_rerun.rerun_checkpoint``): from the
node's saved inputs, which stay attached to the graph upstream, with the forward's RNG state and
autocast restored as torch restores them, so the re-run computes what the forward computed.

Columns then travel in stages (:func:`through`). A *region* is what autograd reaches from a
root without passing a checkpoint node; its stage propagates the root's columns to the module
outputs in it and to the outputs of the checkpoints it meets (the node's inputs, which autograd
captures without running the node). Each segment's stage starts from its re-run outputs with
the columns its checkpoint received, after every stage that feeds it (``J^T`` is linear: the
columns of a module output are the sum over the regions containing it). A module output that a
stage reaches both directly and through a checkpoint (a residual ``x + checkpoint(f, x)``)
would make autograd run the checkpoint node: that raises, naming the fix.

While segments are live (from the loss hook to the end of its curvature work), the re-run graphs
hold the activations of every segment at once, as the model without checkpointing does. The
segments that one loss's walk re-ran belong to that walk (:class:`Segments`, shared by the walks
within it): the regions, and the releases, read the graph as those walks read it
(:meth:`Segments.adopt`), so no node's edges are read twice, and the stages from a root are kept
there while no segment is re-run or released.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torch.autograd.graph import GradientEdge

from curvopt.errors import UnsupportedModuleError
from curvopt.graph.search import edges_of, search
from curvopt.core.extended import module_path, set_path
from curvopt.core.records import records_on
from curvopt.autograd.torch_internals import ACCUMULATE_GRAD
from curvopt.autograd.torch_rerun import rerun_checkpoint

#: key of the autograd-node metadata holding a checkpoint node's live ``Segment``
_METADATA = "curvopt_segment"


class Segments:
    """The live segments one loss's walk re-ran (``walk.Walk.segments``, shared by the walks
    within it), from the loss hook until each is released: ``live``; ``edges``, the graph as
    those walks read it (``node -> next_functions``), which the stages and releases read;
    ``stages``, the regions from each root node (:func:`through`), kept while no segment is
    re-run or released."""

    def __init__(self):
        self.live: set = set()
        self.edges: Dict[object, tuple] = {}
        self.stages: Dict[object, list] = {}

    def on(self, node) -> Optional["Segment"]:
        """The live segment of a reentrant checkpoint's node, if one was re-run."""
        return node.metadata.get(_METADATA) if self.live else None

    def next_of(self, node) -> tuple:
        """The edges of ``node`` as the walks read them."""
        nexts = self.edges.get(node)
        return edges_of(node) if nexts is None else nexts

    def adopt(self, edges: Dict[object, tuple]) -> None:
        """The graph as a walk read it (``node -> next_functions``), while segments are live."""
        if self.live:
            self.edges.update(edges)


def _name(fn) -> str:
    owner = getattr(fn, "__self__", None)
    if isinstance(fn, torch.nn.Module) or isinstance(owner, torch.nn.Module):
        module = fn if isinstance(fn, torch.nn.Module) else owner
        path = module_path(module)
        return path if module is fn else f"{path}.{fn.__name__}"
    return getattr(fn, "__qualname__", type(fn).__name__)


class Segment:
    """A reentrant checkpoint's segment, re-run with grad: ``outputs[i]`` stands for the node's
    output ``i``. Named like a module in errors: it is its own ``module``, and its ``path`` is
    given to ``curvopt.core.extended`` (:func:`~curvopt.core.extended.set_path`). It is live in
    ``owner`` (the walk's :class:`Segments`) until :meth:`release`."""

    def __init__(self, node, owner: Segments):
        self.node = node
        self.owner = owner
        self.path = f"checkpoint({_name(node.run_function)})"
        set_path(self, self.path)
        outputs, drew = rerun_checkpoint(node)
        if drew:
            raise UnsupportedModuleError(
                f"curvopt: the segment {self.path} of torch.utils.checkpoint(..., "
                "use_reentrant=True, preserve_rng_state=False) draws random numbers, so its "
                "recomputation differs from the forward. Use preserve_rng_state=True (the "
                "default) or use_reentrant=False; see "
                "docs/support.md#checkpointing-and-compiled-graphs."
            )
        self.outputs = outputs
        node.metadata[_METADATA] = self
        owner.live.add(self)
        owner.stages.clear()

    @property
    def module(self):
        return self

    @property
    def slots(self) -> List[GradientEdge]:
        """The checkpoint's outputs that carry gradient, as edges into its node."""
        return [GradientEdge(self.node, i) for i in self._differentiable()]

    def _differentiable(self) -> List[int]:
        return [
            i
            for i, t in enumerate(self.outputs)
            if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None
        ]

    def release(self) -> None:
        """Drop the re-run graph and the inputs of the module calls made by the re-run."""
        if self.node.metadata.get(_METADATA) is self:
            del self.node.metadata[_METADATA]
        owner = self.owner
        owner.live.discard(self)
        owner.stages.clear()
        inputs = {id(t.grad_fn) for t in self.node.saved_tensors if t.grad_fn is not None}

        def release(node) -> list:
            if id(node) in inputs:
                return []
            if type(node).__name__ == ACCUMULATE_GRAD or owner.on(node) is not None:
                return []
            for record, _, _ in records_on(node):
                record.release()
            return [fn for fn, _ in owner.next_of(node)]

        search([self.outputs[i].grad_fn for i in self._differentiable()], release)
        self.outputs = ()
        if not owner.live:
            owner.edges.clear()


def reach(starts, stop, nexts, segment_of):
    """``(nodes, barriers, entries)``: the nodes autograd reaches from ``starts`` without
    passing a live checkpoint node (the ``barriers``, segments, in order met) or a node of
    ``stop`` (``entries``: the edges ``(node, output_nr)`` by which the stop nodes are entered).
    ``nexts(node)``: its edges as a walk read them; ``segment_of(node)``: its live segment or
    None (``walk.Walk.segment_of``, :meth:`Segments.on`)."""
    barriers, entries = [], {(node, None) for node in starts if node in stop}

    def expand(node) -> list:
        barrier = segment_of(node)
        if barrier is not None:
            barriers.append(barrier)
            return []
        on = []
        for fn, nr in nexts(node):
            if fn in stop:
                entries.add((fn, nr))
            else:
                on.append(fn)
        return on

    read = search([node for node in starts if node not in stop], expand)
    nodes = {node for node in read if segment_of(node) is None}
    return nodes, barriers, entries


class _Region:
    """What autograd reaches from ``starts`` without passing a live checkpoint node: ``nodes``,
    and the ``barriers`` (segments) it meets. ``segment`` is the one whose re-run starts it
    (``None`` for the root); ``segments``: the live segments."""

    def __init__(self, segment, starts, segments: Segments):
        self.segment = segment
        self.segments = segments
        self.nodes, self.barriers, _ = reach(starts, frozenset(), segments.next_of, segments.on)
        self._above: Optional[set] = None

    def reject_bypass(self, nodes) -> None:
        """Raise if a node asked for lies upstream of a checkpoint this region meets (autograd
        would run the checkpoint to reach it)."""
        if self._above is None:
            nexts = self.segments.next_of
            starts = [fn for b in self.barriers for fn, _ in nexts(b.node)]
            self._above = search(starts, lambda node: [fn for fn, _ in nexts(node)])
        for node in nodes:
            if node in self._above:
                names = ", ".join(b.path for b in self.barriers)
                raise UnsupportedModuleError(
                    f"curvopt cannot propagate curvature around the reentrant checkpoint(s) "
                    f"{names}: a tensor reaches the loss both through and around it "
                    "(x + checkpoint(f, x)). Move that use inside the checkpointed function or "
                    "use use_reentrant=False; see "
                    "docs/support.md#checkpointing-and-compiled-graphs."
                )


def _plan(start, segments: Segments) -> List[_Region]:
    """The regions from ``start`` (a node), each after every region that feeds it (kept in
    ``segments.stages`` while the live segments stay the same)."""
    stages = segments.stages.get(start)
    if stages is None:
        stages = segments.stages[start] = _regions(start, segments)
    return stages


def _regions(start, segments: Segments) -> List[_Region]:
    # the root's region, then one per segment met
    regions = {start: _Region(None, [start], segments)}
    feeders: Dict[object, int] = {}

    def expand(key) -> list:
        for b in regions[key].barriers:
            feeders[b] = feeders.get(b, 0) + 1
            if b not in regions:
                starts = [b.outputs[i].grad_fn for i in b._differentiable()]
                regions[b] = _Region(b, starts, segments)
        return regions[key].barriers

    search([start], expand)
    order, ready = [], [start]
    while ready:  # Kahn: a segment's region once all regions meeting it are placed
        key = ready.pop()
        order.append(regions[key])
        for b in regions[key].barriers:
            feeders[b] -= 1
            if not feeders[b]:
                ready.append(b)
    return order


def through(grad, root, edges, columns: torch.Tensor, batched: bool, segments: Segments):
    """``grad(outputs, inputs, columns, batched)`` (autograd's ``J^T`` from a list of roots to a
    list of edges, ``[k, *edge]`` each or ``None``) from ``root`` (a tensor or edge, columns
    ``[k, *root]``) to ``edges``, across the live ``segments``, in stages."""
    if isinstance(root, torch.Tensor):
        start, nr = root.grad_fn, root.output_nr
    else:
        start, nr = root.node, root.output_nr
    pending: Dict[Segment, list] = {}
    first = segments.on(start)
    if first is not None:  # the root is a checkpoint's output: its columns are the segment's
        pending[first] = [None] * len(first.outputs)
        pending[first][nr] = columns
    result = [None] * len(edges)
    for region in _plan(start, segments):
        if region.segment is None:
            if first is not None:
                continue
            roots, cols = [root], [columns]
        else:
            arrived = pending.get(region.segment, ())
            index = [i for i, v in enumerate(arrived) if v is not None]
            if not index:
                continue
            roots = [region.segment.outputs[i] for i in index]
            cols = [arrived[i] for i in index]
        wanted = [j for j, e in enumerate(edges) if e.node in region.nodes]
        slots = [(b, e) for b in region.barriers for e in b.slots]
        if not wanted and not slots:
            continue
        region.reject_bypass([edges[j].node for j in wanted] + [b.node for b, _ in slots])
        found = grad(roots, [edges[j] for j in wanted] + [e for _, e in slots], cols, batched)
        for j, v in zip(wanted, found):
            if v is not None:
                result[j] = v if result[j] is None else result[j] + v
        for (b, e), v in zip(slots, found[len(wanted) :]):
            if v is not None:
                got = pending.setdefault(b, [None] * len(b.outputs))
                old = got[e.output_nr]
                got[e.output_nr] = v if old is None else old + v
    for j, e in enumerate(edges):  # an edge into a checkpoint: all that arrived there
        b = segments.on(e.node)
        if b is not None:
            result[j] = pending.get(b, [None] * (e.output_nr + 1))[e.output_nr]
    return result
