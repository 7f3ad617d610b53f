"""Columns through the autograd graph: ``J^T`` to the module calls upstream (which calls
lie upstream is ``walk``'s).

PyTorch's autograd applies the transposed Jacobian from a tensor (or gradient edge) to the
outputs of every extended module call upstream, for many columns at once
(``is_grads_batched``, i.e. ``vmap`` over the backward graph: ``torch_internals.batched_vjp``,
its steps without ``grad``'s argument handling) where every backward op has a
batching rule, in batched stages across max pooling (``pooling``) where the walk of the graph
is given, one column at a time otherwise.

The special ways across the graph are chosen from the walk, not found again per chunk:
reentrant checkpoints where the walk re-ran one (``walk.Walk.segmented``; their stages are kept
per root while the segments live, ``checkpointing``), max pooling where the columns cannot go
batched (the walk met a node without a batching rule, ``walk.Walk.batchable``; the stages made
once per walk, root and edges, ``pooling.pool_stages``), broadcast calls where the walk bound
them on their records (``Record.broadcast``, ``broadcast``: the columns read at the
broadcasting op's output, by sample). Which columns go, and in what chunks, is the engine's
(``engine.curvature``).
"""

from __future__ import annotations

import torch

from curvopt.graph.pooling import across_pools, pool_stages
from curvopt.graph.checkpointing import through
from curvopt.core.state import STATE
from curvopt.autograd.torch_internals import batched_vjp


def backpropagate(outputs, edges, columns: torch.Tensor, batched: bool, walk):
    """``J^T`` of each edge applied to every column (``[k, *out]`` per edge, None if unused).

    ``walk``: the ``walk.Walk`` of a graph holding ``outputs``. Batched through ``vmap`` where
    ``batched``; a backward op that ``vmap`` cannot run (a custom ``autograd.Function`` without
    a batching rule) falls back to one column at a time. Across reentrant checkpoints that
    curvopt re-ran (``walk.segmented``), in stages (``checkpointing.through``); across max
    pooling, batched in stages where the walk allows it (``pooling``).
    """
    if walk.segmented:
        return through(_grad, outputs, edges, columns, batched, walk.segments)
    if not batched and columns.shape[0] > 1:
        stages = pool_stages(outputs, edges, walk)
        if stages is not None:
            return across_pools(_grad, stages, outputs, edges, columns)
    return _grad([outputs], edges, [columns], batched)


def _grad(outputs, edges, columns, batched: bool):
    """``backpropagate`` from several roots (``columns[i]`` ``[k, *outputs[i]]``)."""
    with STATE.suspend():
        if batched:
            try:
                return batched_vjp(tuple(outputs), tuple(edges), tuple(columns))
            except (RuntimeError, NotImplementedError):
                pass
        per_column = [
            torch.autograd.grad(outputs, edges, list(column), retain_graph=True, allow_unused=True)
            for column in zip(*columns)
        ]
    if len(per_column) == 1:  # one column (Monte-Carlo): no copy where its layout is stack's
        return [None if part is None else part.unsqueeze(0).contiguous() for part in per_column[0]]
    return [None if parts[0] is None else torch.stack(parts) for parts in zip(*per_column)]


def to_calls(root, calls, columns: torch.Tensor, batched: bool, walk, extra=()):
    """``{record: [columns at output i, or None where they do not arrive]}`` for ``calls``
    (``[k, *out_i]`` per output of each call), from ``columns`` (``[k, *root.shape]``). A call
    whose output is the root itself (the last layer feeding the loss) takes the columns as
    they are, without autograd. With ``extra`` (gradient edges): ``(outs, [columns at each
    extra edge])``, in the same autograd call. ``walk``: as for ``backpropagate``."""
    root_edge = None
    if isinstance(root, torch.Tensor) and root.grad_fn is not None:
        root_edge = (root.grad_fn, root.output_nr)
    records = list(calls)
    edges = [e for r in records for _, e in calls[r] if (e.node, e.output_nr) != root_edge]
    edges += list(extra)
    found = list(backpropagate(root, edges, columns, batched, walk)) if edges else []
    back = iter(found[: len(found) - len(extra)])
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
    return (outs, found[len(found) - len(extra) :]) if extra else outs


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
