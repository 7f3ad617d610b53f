"""Fewer exact columns below a language model's head: ``d`` per loss row instead of ``V``.

The exact square root of a cross-entropy row's Hessian has ``V`` columns. When the loss input
``z [R, V]`` is the output of one position-wise module call (the head, ``z_r = f(h_r)``) on
``h [.., d]`` with ``d < V``, the columns of row ``r`` pulled back to ``h`` live at position
``r`` of ``h`` alone, and everything below ``h`` depends on them only through their Gram
``M_r = Σ_k c_rk c_rkᵀ`` (``d × d``): every diagonal and Kronecker factor below is a sum over
columns of squares of linear maps of them. So the ``K`` columns of each row can be replaced
at ``h`` by the ``min(K, d)`` rows of ``R_r`` from ``C_r = Q_r R_r`` (QR of the ``K × d``
matrix of the row's columns: ``R_rᵀ R_r = M_r``, without squaring ``C_r`` as a Gram would),
before they enter the layers below (attention mixes positions: ``T·V`` columns per sample
become ``T·d``). The head itself gets the uncompressed columns (its factors need them).

A head whose parameters all need no gradient (a frozen or tied output layer with only the
layers below trained) is no recorded call: it is found in the graph instead, as ``h Wᵀ (+ b)``
(``F.linear`` or a matmul by the weight) reached from the loss input through shape ops alone,
with ``h`` its ``[R, d]`` operand.

Checked, never assumed (:func:`find_cut`, :func:`squeeze`): the head is the one module call the
loss input reaches first, declared position-wise by its rule, or that frozen product; its input
``h`` has the loss's rows as positions; every other module call reaches the loss only through
``h`` (else ``h`` would not hold all their curvature); no parameter of the head is used below
``h`` where diagonals are asked (their cross terms pair the columns of both uses one to one);
the columns at the head's output are the loss's columns unchanged (the rows of ``z`` are the
head's positions in order); and on every chunk the columns at ``h`` vanish exactly outside
their own row's slot. Where any fails, the columns go on uncompressed. Reentrant checkpoints
below ``h`` are crossed in stages from ``h`` as from the loss (``propagate.backpropagate``);
one above it (met before ``h``) leaves the columns as they are.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from curvopt.engine.checkpointing import reach
from curvopt.engine.params import trainable
from curvopt.engine.torch_internals import (
    FROZEN_PRODUCTS,
    NO_BATCHING_RULE,
    SHAPE_OPS,
    input_shape,
)


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
    nodes, barriers, entries = reach([root.grad_fn], {cut.edge.node}, walk.next_of)
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
        _, _, entries = reach([root.grad_fn], {node for node, _ in outputs}, walk.next_of)
        met = {outputs.get(edge) for edge in entries}
        first = met.pop() if len(met) == 1 else None
    return first


def squeeze(at_h, top_out, columns, layout, first: int, stop: int) -> Optional[torch.Tensor]:
    """``[min(k, d) * s, *h]``: the columns ``at_h`` (``[k * s, *h]`` for the ``k`` loss
    columns of slots ``first:stop``, packed as ``rows.RowLayout.pack`` packs ``columns``
    ``[k * s, R, V]``) re-factored per row (module doc); ``None`` if a check fails (``top_out``:
    the columns at the head's output)."""
    slots, rows, width = stop - first, columns.shape[1], at_h.shape[-1]
    k = at_h.shape[0] // slots
    if (
        k <= width
        or top_out is None
        or top_out.numel() != columns.numel()
        or not torch.equal(top_out.reshape(columns.shape), columns)
    ):
        return None
    c = at_h.reshape(k, slots, rows, width)
    if layout.slot is None:
        own = torch.ones(1, rows, dtype=torch.bool, device=c.device)
    else:
        slot = layout.slot.to(c.device)
        own = slot[None, :] == torch.arange(first, stop, device=c.device)[:, None]
    if bool((c[:, ~own] != 0).any()):
        return None  # a row's columns outside its own position: not position-wise
    s, r = own.nonzero(as_tuple=True)
    per_row = c[:, s, r].transpose(0, 1)  # [rows in use, k, d]
    if per_row.dtype not in (torch.float32, torch.float64):  # no QR in half precision
        per_row = per_row.float()
    factor = torch.linalg.qr(per_row, mode="r").R  # [rows in use, d, d]
    out = c.new_zeros(factor.shape[1], slots, rows, width)
    out[:, s, r] = factor.transpose(0, 1).to(c.dtype)
    return out.reshape(-1, *at_h.shape[1:])
