"""Columns through the autograd graph: which module calls lie upstream, and ``J^T`` of each.

PyTorch's autograd applies the transposed Jacobian from a tensor (or gradient edge) to the
outputs of every extended module call upstream, for many columns at once
(``is_grads_batched``, i.e. ``vmap`` over the backward graph) where every backward op has a
batching rule, one column at a time otherwise.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Optional, Tuple

import torch
from torch.autograd.graph import GradientEdge

from curvopt.broadcast import find
from curvopt.checkpointing import Segment, live, segment_on, through
from curvopt.errors import UnsupportedModuleError
from curvopt.records import records_on, token
from curvopt.state import STATE
from curvopt.torch_internals import (
    ACCUMULATE_GRAD,
    COMPILED,
    DATA_INDEXING,
    NO_BATCHING_RULE,
    REENTRANT_CHECKPOINT,
)


class Upstream:
    """The extended-module calls upstream of a root: ``calls[record] = [(output index, edge)]``,
    whether columns may be propagated batched, a key of the graph's structure (``None``
    where the graph indexes by data, so that what holds for one batch need not for the next),
    ``foreign``: the parameters it reaches that no extended module owns, and ``consumers``:
    ``consumers[(node, nr)] = [(consumer, j)]``, the nodes of the graph that take output ``nr``
    of ``node`` as their ``j``-th input (``consumer.next_functions[j]``)."""

    def __init__(
        self, calls, batchable: bool, signature: Optional[Tuple], foreign=(), consumers=None
    ):
        self.calls: Dict[object, List[Tuple[int, GradientEdge]]] = calls
        self.batchable = batchable
        self.signature = signature
        self.foreign = list(foreign)
        self.consumers: Dict[Tuple[object, int], List[Tuple[object, int]]] = consumers or {}
        self.root = None  # the autograd node the walk started from
        self.indexes_inside = False  # see ``_indexes_inside``
        self.reentrant = False  # a reentrant checkpoint lies upstream (REENTRANT_CHECKPOINT)


def module_outputs(root, recompute: Optional[list] = None) -> Upstream:
    """Walk the graph upstream of ``root`` (a tensor or an autograd node). A reentrant
    checkpoint is walked through where curvopt re-ran its segment, and re-run on the way where
    ``recompute`` is a list (the new ``checkpointing.Segment``s are appended to it, for the
    caller to release)."""
    found: Dict[object, List[Tuple[int, GradientEdge]]] = defaultdict(list)
    consumers = defaultdict(list)
    start = root.grad_fn if isinstance(root, torch.Tensor) else root
    stack, seen, batchable, kinds, foreign = [start], set(), True, [], []
    reentrant = False
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        kind = type(node).__name__
        if kind in COMPILED:
            raise UnsupportedModuleError(
                "curvopt cannot propagate curvature through a graph compiled by torch.compile "
                "(its backward is one fused op); compute curvature on the uncompiled model "
                "(for a compiled module m, use m._orig_mod) — first-order quantities do work "
                "with torch.compile"
            )
        kinds.append(kind)
        if kind == REENTRANT_CHECKPOINT:
            segment = segment_on(node)
            if segment is None and recompute is not None:
                segment = Segment(node)
                recompute.append(segment)
            if segment is None:
                reentrant = True
                continue  # nothing upstream can be reached by columns
            for t in segment.outputs:
                if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                    # the checkpoint node takes the re-run output (no input index of its own)
                    consumers[(t.grad_fn, t.output_nr)].append((node, None))
                    stack.append(t.grad_fn)
            continue
        if kind == ACCUMULATE_GRAD:
            leaf = node.variable
            if isinstance(leaf, torch.nn.Parameter) and not getattr(leaf, "_curvopt_checked", 0):
                foreign.append(leaf)
        batchable = batchable and kind not in NO_BATCHING_RULE
        for record, index, output_nr in records_on(node):
            found[record].append((index, GradientEdge(node, output_nr)))
            kinds.append((token(record.module), index, record.out_shapes))
        for j, (fn, nr) in enumerate(node.next_functions):
            if fn is not None:
                consumers[(fn, nr)].append((node, j))
                stack.append(fn)
    for record, edges in found.items():
        if len(record.out_shapes) == 1:
            ((index, edge),) = edges
            record.broadcast = find(edge.node, edge.output_nr, record.out_shapes[0], consumers)
            if record.broadcast is not None:
                found[record] = [(index, record.broadcast.edge)]
                kinds.append(("broadcast", token(record.module)))
    by_data = any(kind in DATA_INDEXING for kind in kinds if isinstance(kind, str))
    upstream = Upstream(found, batchable, None if by_data else tuple(kinds), foreign, consumers)
    upstream.indexes_inside = by_data and _indexes_inside(found)
    upstream.reentrant = reentrant
    upstream.root = start
    return upstream


def _indexes_inside(found) -> bool:
    """Whether an op that picks entries by data lies upstream of a module call's output, i.e.
    inside the model, where it may mix samples (``h[perm]``), rather than between the model and
    the loss (``logits[mask]``)."""
    stack = [edge.node for edges in found.values() for _, edge in edges]
    seen = set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ in DATA_INDEXING:
            return True
        stack.extend(fn for fn, _ in node.next_functions)
    return False


def backpropagate(outputs, edges, columns: torch.Tensor, batched: bool):
    """``J^T`` of each edge applied to every column (``[k, *out]`` per edge, None if unused).

    Batched through ``vmap`` where ``batched``; a backward op that ``vmap`` cannot run (a custom
    ``autograd.Function`` without a batching rule) falls back to one column at a time. Across
    reentrant checkpoints that curvopt re-ran, in stages (``checkpointing.through``).
    """
    if live():
        return through(_grad, outputs, edges, columns, batched)
    return _grad([outputs], edges, [columns], batched)


def _grad(outputs, edges, columns, batched: bool):
    """``backpropagate`` from several roots (``columns[i]`` ``[k, *outputs[i]]``)."""
    with STATE.suspend():
        if batched:
            try:
                return torch.autograd.grad(
                    outputs,
                    edges,
                    columns,
                    retain_graph=True,
                    is_grads_batched=True,
                    allow_unused=True,
                )
            except (RuntimeError, NotImplementedError):
                pass
        per_column = [
            torch.autograd.grad(outputs, edges, list(column), retain_graph=True, allow_unused=True)
            for column in zip(*columns)
        ]
    return [None if parts[0] is None else torch.stack(parts) for parts in zip(*per_column)]


def to_calls(root, calls, columns: torch.Tensor, batched: bool):
    """``{record: [columns at output i, or None where they do not arrive]}`` for ``calls``
    (``[k, *out_i]`` per output of each call), from ``columns`` (``[k, *root.shape]``). A call
    whose output is the root itself (the last layer feeding the loss) takes the columns as
    they are, without autograd."""
    root_edge = None
    if isinstance(root, torch.Tensor) and root.grad_fn is not None:
        root_edge = (root.grad_fn, root.output_nr)
    records = list(calls)
    edges = [e for r in records for _, e in calls[r] if (e.node, e.output_nr) != root_edge]
    back = iter(backpropagate(root, edges, columns, batched) if edges else ())
    outs = {}
    for record in records:
        outs[record] = [None] * len(record.out_shapes)
        for index, edge in calls[record]:
            v = columns if (edge.node, edge.output_nr) == root_edge else next(back)
            if v is not None and record.broadcast is not None:
                v = record.broadcast.per_sample(v)
            else:
                v = record.shaped(index, v, columns=True)
            if v is not None and record.transposed:
                v = v.movedim(2, 1)
            outs[record][index] = v
    return outs


def loss_gradient(loss, weight: float) -> torch.Tensor:
    """``weight * d loss / d input`` of an extended loss call (a ``LossRecord``); a bf16/fp16
    input in float32, as autocast runs the losses (curvopt computes with autocast off)."""
    with STATE.suspend(), torch.enable_grad():
        o = loss.output.detach()
        if o.is_floating_point() and torch.finfo(o.dtype).bits < 32:
            o = o.float()
        o.requires_grad_(True)
        (g,) = torch.autograd.grad(loss.module(o, loss.target), o)
    return g * weight
