"""Fewer exact columns below a language model's head: ``d`` per loss row instead of ``V``.

The exact square root of a cross-entropy row's Hessian has ``V`` columns. When the loss input
``z [R, V]`` is the output of one position-wise module call (the head, ``z_r = f(h_r)``) on
``h [.., d]`` with ``d < V``, the columns of row ``r`` pulled back to ``h`` live at position
``r`` of ``h`` alone, and everything below ``h`` depends on them only through their Gram
``M_r = Σ_k c_rk c_rkᵀ`` (``d × d``): every diagonal and Kronecker factor below is a sum over
columns of squares of linear maps of them. So the columns go to ``h`` with all rows at once
(``V`` columns ``[V, R, V]``, not ``V`` per slot of ``layouts.RowLayout``: above ``h`` no row
reaches another), each row's ``K × d`` matrix there is replaced by the ``min(K, d)`` rows of
its R factor (:class:`RowFactors`: ``F_rᵀ F_r = M_r``, without squaring as a Gram would), and
only those, packed by slot again, enter the layers below (attention mixes positions: ``T·V``
columns per sample become ``T·d``). The head itself gets the uncompressed columns, packed by
slot (its factors need them). :class:`HeadCut` is this way of propagating, one of the
strategies of ``curvature`` (chosen there, from the walk: ``curvature.choose``): given the loss's
columns (``curvature.LossColumns``) and a ``contribute(calls, outs)`` callback, it makes the two
stages and hands each chunk's columns back, as ``curvature.Direct`` does for the plain way.

A head whose parameters all need no gradient (a frozen or tied output layer with only the
layers below trained) is no recorded call: it is found in the graph instead, as ``h Wᵀ (+ b)``
(``F.linear`` or a matmul by the weight) reached from the loss input through shape ops alone,
with ``h`` its ``[R, d]`` operand.

Checked, never assumed (:func:`find_cut`, :func:`row_local`): the head is the one module call
the loss input reaches first, declared position-wise by its rule, or that frozen product; its
input ``h`` has the loss's rows as positions; every other module call reaches the loss only
through ``h`` (else ``h`` would not hold all their curvature); no parameter of the head is
used below ``h`` where diagonals are asked (their cross terms pair the columns of both uses
one to one); and on every pass, before any column is propagated, random probe columns
(:func:`row_probes`) arrive at the head's output unchanged and at ``h`` on their own rows
alone. Where any fails, the columns go on uncompressed. ``find_cut`` runs on every pass of a
structure where it found a cut (binding it to the pass's nodes, every condition checked
again); a structure where it found none is remembered in its plan (``curvature``) and takes
the uncompressed way, exact whatever the graph, without a search.

Reentrant checkpoints below ``h`` are crossed in stages from ``h`` as from the loss
(``propagate.backpropagate``); one above it (met before ``h``) leaves the columns as they are.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from curvopt.graph.checkpointing import reach
from curvopt.graph.propagate import to_calls
from curvopt.core.params import trainable
from curvopt.engine.rows import probe_sets
from curvopt.autograd.torch_internals import (
    FROZEN_PRODUCTS,
    NO_BATCHING_RULE,
    SHAPE_OPS,
    input_shape,
)

#: bound on the elements held at once by the columns of a loss row that compress together at
#: the head (:class:`HeadCut`): more than the head's width of them are needed at once (64 MB in
#: float32), and below the cut they are at most that width per row again
_CUT_BUDGET = 1 << 24


class Cut:
    """Where columns are compressed: ``h`` (``[.., width]``, of ``shape``), the input of the
    head whose output the loss input is: the call ``top``, or a frozen linear map found in the
    graph (``top`` None). ``root``: ``h`` as the tensor or gradient edge columns start from
    below; ``edge``: its gradient edge."""

    def __init__(self, top, root, shape):
        self.top = top
        self.root = root
        self.edge = root if isinstance(root, GradientEdge) else get_gradient_edge(root)
        self.shape = tuple(shape)
        self.width = self.shape[-1]
        self.numel = math.prod(self.shape)
        #: the loss input's graph down to ``h`` has batching rules (the rest may not)
        self.batchable = False

    def above(self, calls) -> dict:
        """The calls of ``calls`` above ``h`` (the head's, if recorded)."""
        return {} if self.top is None else {self.top: calls[self.top]}

    def below(self, calls) -> dict:
        return {record: edges for record, edges in calls.items() if record is not self.top}

    def head_output(self, outs, columns):
        """The columns at the head's output: the loss's own for a head found in the graph
        (only shape ops lie between, checked by :func:`_frozen_head`)."""
        return columns if self.top is None else outs[self.top][0]


def find_cut(walk, calls, root: torch.Tensor, diagonals: bool) -> Optional[Cut]:
    """The cut at the head's input for the loss input ``root`` ``[R, V]`` (module doc), or
    ``None`` where its conditions fail; ``diagonals``: diagonal quantities are asked."""
    if not calls or root.dim() != 2 or root.grad_fn is None:
        return None
    cut = _frozen_head(walk, root) or _recorded_head(walk, calls, root)
    if cut is None:
        return None
    nodes, barriers, entries = reach([root.grad_fn], {cut.edge.node}, walk.next_of, walk.segment_of)
    if barriers or entries != {(cut.edge.node, cut.edge.output_nr)}:
        return None  # a checkpoint above h, or h's node entered through another output too
    below = cut.below(calls)
    if not below or any(e.node in nodes for edges in below.values() for _, e in edges):
        return None  # nothing below h, or a call reaching the loss around it
    cut.batchable = not any(type(node).__name__ in NO_BATCHING_RULE for node in nodes)
    if diagonals and cut.top is not None:
        above = {id(p) for _, p in trainable(cut.top.module)}
        if any(id(p) in above for r in below for _, p in trainable(r.module)):
            return None  # a weight tied across the cut: its diagonal pairs the columns
    return cut


def _recorded_head(walk, calls, root) -> Optional[Cut]:
    """The cut at the input of the last call (the head), if it is position-wise on the loss's
    rows, with another call below it."""
    top = _last_call(walk, calls, root) if len(calls) > 1 else None
    if top is None:
        return None
    h = top.args[0] if top.args else None
    if (
        not top.positionwise
        or top.broadcast is not None
        or top.transposed
        or len(top.out_shapes) != 1
        or not isinstance(h, torch.Tensor)
        or h.grad_fn is None
        or h.dim() < 2
        or h.shape[:-1] != top.out_shapes[0][:-1]
        or math.prod(h.shape[:-1]) != root.shape[0]
    ):
        return None
    return Cut(top, h, h.shape)


def _frozen_head(walk, root) -> Optional[Cut]:
    """The cut at ``h`` where the loss input ``[R, V]`` is, up to shape ops, ``h Wᵀ (+ b)``
    with ``h [R, d]`` and a weight (and bias) that need no gradient: a frozen head, which no
    module call records (``torch_internals.FROZEN_PRODUCTS``)."""
    node = root.grad_fn
    while type(node).__name__ in SHAPE_OPS and len(walk.next_of(node)) == 1:
        node = walk.next_of(node)[0][0]
    operand = FROZEN_PRODUCTS.get(type(node).__name__)
    if operand is None or input_shape(node, 0) != tuple(root.shape):
        return None
    nexts = walk.next_of(node)
    if any(fn is not None for j, (fn, _) in enumerate(nexts) if j != operand):
        return None  # a weight or bias that needs gradient: not frozen
    fn, nr = nexts[operand]
    if fn is None:
        return None
    shape = input_shape(fn, nr)
    if len(shape) != 2 or shape[0] != root.shape[0]:
        return None
    return Cut(None, GradientEdge(fn, nr), shape)


def _last_call(walk, calls, root):
    """The one call whose output the root reaches first (the head), or ``None``."""
    outputs = {(e.node, e.output_nr): record for record, edges in calls.items() for _, e in edges}
    first = outputs.get((root.grad_fn, root.output_nr))
    if first is None:
        _, _, entries = reach(
            [root.grad_fn], {node for node, _ in outputs}, walk.next_of, walk.segment_of
        )
        met = {outputs.get(edge) for edge in entries}
        first = met.pop() if len(met) == 1 else None
    return first


class RowFactors:
    """Per loss row ``r`` of ``rows``, an upper triangular ``F_r`` (``[m, d]``, ``m ≤ d``) with
    ``F_rᵀ F_r = Σ_k c_rk c_rkᵀ`` over the columns ``c_rk`` at ``h`` added so far: the R factor
    of the QR decomposition of the row's ``K × d`` column matrix, updated chunk by chunk
    (``F ← R([F; C])``, exact: ``[F; C]ᵀ[F; C] = FᵀF + CᵀC``), never squared into a Gram (so
    float32 loses nothing to squaring). QR in float32 for half-precision columns."""

    def __init__(self, cut: Cut, rows: int):
        self.shape, self.rows = cut.shape, rows
        self.factor: Optional[torch.Tensor] = None  # [rows, m, d]

    def add(self, at_h: torch.Tensor) -> None:
        """Fold in the columns ``at_h`` (``[k, *h]``, all rows at once: row ``r`` at ``h``'s
        position ``r``)."""
        c = at_h.reshape(at_h.shape[0], self.rows, -1).transpose(0, 1)  # [rows, k, d]
        if c.dtype not in (torch.float32, torch.float64):
            c = c.float()
        if self.factor is not None:
            c = torch.cat([self.factor, c], 1)
        self.factor = torch.linalg.qr(c, mode="r").R

    def columns(self, layout, first: int, stop: int, dtype) -> torch.Tensor:
        """``[m · (stop - first), *h]``: for each slot ``s`` of ``first:stop`` of
        ``layouts.RowLayout`` ``layout`` and each ``j < m``, the column holding ``F_r[j]`` at the
        position of every row ``r`` of slot ``s`` (rows of distinct samples, as the loss's
        columns were packed) and zeros elsewhere."""
        f = self.factor
        out = f.new_zeros(f.shape[1], stop - first, self.rows, f.shape[2])
        if layout.slot is None:
            out[:, 0] = f.transpose(0, 1)
        else:
            s, r = layout.masks(first, stop, torch.bool, f.device).nonzero(as_tuple=True)
            out[:, s, r] = f[r].transpose(0, 1)
        return out.to(dtype).reshape(-1, *self.shape)


def row_probes(root: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(columns [k, R, V], sets [k, R] bool)``: probe columns for the loss input ``root``
    ``[R, V]``, column ``j`` random (a private generator, seeded) on the rows of set ``j`` and
    zero elsewhere; the sets are ``rows.probe_sets``' codes over rows, so that for any two rows
    ``r != r'`` some column holds ``r`` and not ``r'``."""
    gen = torch.Generator(device=root.device).manual_seed(0)
    sets = probe_sets(root.shape[0]).to(root.device).T  # [k, R]
    noise = torch.randn(root.shape, generator=gen, dtype=root.dtype, device=root.device)
    return noise * sets[:, :, None].to(root.dtype), sets


def row_local(probes, sets, at_head_output, at_h) -> bool:
    """Whether the probe columns (``row_probes``) arrive at the head's output unchanged and
    at ``h`` (``[k, *h]``) on their own rows alone: the map from the loss input to ``h`` is
    position-wise with ``h``'s positions the loss's rows in order (the backward is linear and
    the same for every column, so random probes check it almost surely). Then the loss's
    columns can go to ``h`` with all rows at once and be re-factored per row there."""
    if at_head_output is None or at_h is None or at_head_output.numel() != probes.numel():
        return False
    if not torch.equal(at_head_output.reshape(probes.shape), probes):
        return False
    outside = ~sets[:, :, None]
    return not bool((at_h.reshape(*sets.shape, -1) != 0).logical_and(outside).any())


class HeadCut:
    """The exact columns in two stages around ``cut`` (a strategy, ``curvature``): to the head
    and ``h`` with all rows at once, re-factored per row at ``h`` (:class:`RowFactors`), then
    ``d`` per row and slot below. First, on every pass, probe columns check that the graph
    above ``h`` is row-local (:func:`row_probes`, :func:`row_local`); where it is not, the
    columns go the ``fallback`` way (``curvature.Direct``) instead."""

    def __init__(self, cut: Cut, calls, batched: bool, walk, fallback):
        self.cut, self.walk, self.fallback = cut, walk, fallback
        self.above, self.below = cut.above(calls), cut.below(calls)
        self.batched = batched  # below h
        self.batched_above = batched or cut.batchable

    def propagate(self, columns, contribute) -> None:
        """``columns`` (``curvature.LossColumns``, exact) to every call, each chunk's given to
        ``contribute(calls, outs)``: the head's packed by slot, as without the cut."""
        if not self._row_local(columns.root):
            self.fallback.propagate(columns, contribute)
            return
        factors = self._above_h(columns, contribute)
        self._below_h(columns, factors, contribute)

    def _row_local(self, root) -> bool:
        """Whether the probe columns go to the head's output unchanged and to ``h`` on their own
        rows alone (checked on every pass, before any column is propagated)."""
        cut, above = self.cut, self.above
        probes, sets = row_probes(root.detach())
        outs, (at_h,) = to_calls(root, above, probes, self.batched_above, self.walk, [cut.edge])
        return row_local(probes, sets, cut.head_output(outs, probes), at_h)

    def _above_h(self, columns, contribute) -> RowFactors:
        """The exact columns to ``h`` with all rows at once, folded into each row's factor; the
        head's own quantities from its columns packed by slot."""
        cut, above, root, layout = self.cut, self.above, columns.root, columns.layout
        factors = RowFactors(cut, root.shape[0])
        for cols in columns.rows(columns.fit(above, cut.numel, _CUT_BUDGET)):
            outs, (at_h,) = to_calls(root, above, cols, self.batched_above, self.walk, [cut.edge])
            factors.add(at_h)
            if above:  # the head's own quantities: from its columns packed by slot, as without
                head = cut.head_output(outs, cols)
                k, per_slot = head.shape[0], head[0].numel()
                step = max(1, columns.budget // (k * per_slot))
                for first in range(0, layout.num_slots, step):
                    stop = min(layout.num_slots, first + step)
                    packed = layout.pack(head.reshape(k, root.shape[0], -1), first, stop)
                    outs = {cut.top: [packed.reshape(-1, *head.shape[1:])]}
                    contribute(above, outs)
        return factors

    def _below_h(self, columns, factors: RowFactors, contribute) -> None:
        """Each row's factor rows, packed by slot, from ``h`` to the calls below it."""
        cut, below, root, layout = self.cut, self.below, columns.root, columns.layout
        step = max(1, columns.fit(below, cut.numel - root.numel()) // factors.factor.shape[1])
        for first in range(0, layout.num_slots, step):
            short = factors.columns(layout, first, min(layout.num_slots, first + step), root.dtype)
            outs = to_calls(cut.root, below, short, self.batched, self.walk)
            contribute(below, outs)
            del outs, short
