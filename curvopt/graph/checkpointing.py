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
regions, and the releases, read the graph as the loss's walk read it (``walk.Walk``,
``adopt``): no node's edges are read twice.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torch.autograd.graph import GradientEdge

from curvopt.errors import UnsupportedModuleError
from curvopt.graph.graph_plan import edges_of, forget_stages, search, stages_of
from curvopt.core.extended import module_path, set_path
from curvopt.core.records import records_on
from curvopt.autograd.torch_internals import ACCUMULATE_GRAD
from curvopt.autograd.torch_rerun import rerun_checkpoint

#: key of the autograd-node metadata holding a checkpoint node's live ``Segment``
_METADATA = "curvopt_segment"
_LIVE: set = set()  # the live segments
#: ``node -> next_functions`` as the walk that re-ran the live segments read them
#: (``walk.Walk``, ``adopt``): the stages and releases read the graph from it
_EDGES: Dict[object, tuple] = {}


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
    given to ``curvopt.core.extended`` (:func:`~curvopt.core.extended.set_path`)."""

    def __init__(self, node):
        self.node = node
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
        _LIVE.add(self)
        forget_stages()

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
        _LIVE.discard(self)
        forget_stages()
        inputs = {id(t.grad_fn) for t in self.node.saved_tensors if t.grad_fn is not None}

        def release(node) -> list:
            if id(node) in inputs:
                return []
            if type(node).__name__ == ACCUMULATE_GRAD or segment_on(node) is not None:
                return []
            for record, _, _ in records_on(node):
                record.release()
            return [fn for fn, _ in _next(node)]

        search([self.outputs[i].grad_fn for i in self._differentiable()], release)
        self.outputs = ()
        if not _LIVE:
            _EDGES.clear()


def adopt(edges: Dict[object, tuple]) -> None:
    """The graph as a walk read it (``node -> next_functions``), while segments are live."""
    if _LIVE:
        _EDGES.update(edges)


def _next(node) -> tuple:
    nexts = _EDGES.get(node)
    return edges_of(node) if nexts is None else nexts


def segment_on(node) -> Optional[Segment]:
    """The live segment of a reentrant checkpoint's node, if curvopt re-ran it."""
    return node.metadata.get(_METADATA) if _LIVE else None


def live() -> bool:
    """Whether any segment is live (else columns take the plain path)."""
    return bool(_LIVE)


def reach(starts, stop=frozenset(), nexts=None):
    """``(nodes, barriers, entries)``: the nodes autograd reaches from ``starts`` without
    passing a live checkpoint node (the ``barriers``, segments, in order met) or a node of
    ``stop`` (``entries``: the edges ``(node, output_nr)`` by which the stop nodes are entered).
    ``nexts(node)``: its edges as a walk read them (default: as the live segments' walk)."""
    nexts = _next if nexts is None else nexts
    barriers, entries = [], {(node, None) for node in starts if node in stop}

    def expand(node) -> list:
        barrier = segment_on(node)
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
    nodes = {node for node in read if segment_on(node) is None}
    return nodes, barriers, entries


class _Region:
    """What autograd reaches from ``starts`` without passing a live checkpoint node: ``nodes``,
    and the ``barriers`` (segments) it meets. ``segment`` is the one whose re-run starts it
    (``None`` for the root)."""

    def __init__(self, segment, starts):
        self.segment = segment
        self.nodes, self.barriers, _ = reach(starts)
        self._above: Optional[set] = None

    def reject_bypass(self, nodes) -> None:
        """Raise if a node asked for lies upstream of a checkpoint this region meets (autograd
        would run the checkpoint to reach it)."""
        if self._above is None:
            starts = [fn for b in self.barriers for fn, _ in _next(b.node)]
            self._above = search(starts, lambda node: [fn for fn, _ in _next(node)])
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


def _plan(start) -> List[_Region]:
    """The regions from ``start`` (a node), each after every region that feeds it (kept in
    ``graph_plan``'s cache of stages while the live segments stay the same)."""
    return stages_of(start, lambda: _regions(start))


def _regions(start) -> List[_Region]:
    regions = {start: _Region(None, [start])}  # the root's region, then one per segment met
    feeders: Dict[object, int] = {}

    def expand(key) -> list:
        for b in regions[key].barriers:
            feeders[b] = feeders.get(b, 0) + 1
            if b not in regions:
                regions[b] = _Region(b, [b.outputs[i].grad_fn for i in b._differentiable()])
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


def through(grad, root, edges, columns: torch.Tensor, batched: bool):
    """``grad(outputs, inputs, columns, batched)`` (autograd's ``J^T`` from a list of roots to a
    list of edges, ``[k, *edge]`` each or ``None``) from ``root`` (a tensor or edge, columns
    ``[k, *root]``) to ``edges``, across the live segments, in stages."""
    if isinstance(root, torch.Tensor):
        start, nr = root.grad_fn, root.output_nr
    else:
        start, nr = root.node, root.output_nr
    pending: Dict[Segment, list] = {}
    first = segment_on(start)
    if first is not None:  # the root is a checkpoint's output: its columns are the segment's
        pending[first] = [None] * len(first.outputs)
        pending[first][nr] = columns
    result = [None] * len(edges)
    for region in _plan(start):
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
        b = segment_on(e.node)
        if b is not None:
            result[j] = pending.get(b, [None] * (e.output_nr + 1))[e.output_nr]
    return result
