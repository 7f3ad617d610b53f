"""Columns through max pooling, all at once.

``vmap`` has no batching rule for torch's max-pool backward, so columns would cross a graph
with max pooling one at a time. The pooling's transposed Jacobian is known instead: each entry
of a column goes to the input position of its window's maximum (the node's saved indices,
``torch_internals.max_pool_transpose``), for all columns in one ``scatter_add``. The constant
padding before a 'same' pooling or convolution (``F.pad``, ``nn.ZeroPad2d``) is crossed the same
way where the stages allow it: ``vmap`` runs its backward column by column and stacks the
results, its transpose crops all columns at once (``torch_internals.pad_transpose``). Below,
"pooling" stands for both.

Columns then travel in stages (:func:`across_pools`), as across reentrant checkpoints
(``checkpointing``): a *region* is what autograd reaches from a root without passing a max-pool
node; its stage, one batched autograd call, takes the columns to the edges asked for in it and
to the pooling nodes it meets (their inputs, which autograd captures without running the node).
A pooling's own region starts at its input, with the columns it received scattered there,
after every stage that feeds it (``J^T`` is linear: an edge's columns are the sum over the
regions that reach it).

:func:`pool_stages` gives no stages (``None``: the columns go one at a time, as autograd runs them)
where a stage would make autograd run a pooling node (an edge asked for, or a pooling met, lies
upstream of a pooling that the same region meets: a path around it), or where another node of
the graph has no batching rule. The graph is read as the loss's walk read it.

Where the choice is made: ``propagate.backpropagate`` asks for the stages where the walk found
a node without a batching rule (``walk.Walk.batchable`` false) and more than one column goes;
they (or ``None``) are made once per walk, root and edges asked (``walk.Walk.pool_stages``)
and reused by every chunk of columns that takes the same way, so a pass searches its graph for
them once, not once per chunk.
"""

from __future__ import annotations

from typing import List, Optional

import torch
from torch.autograd.graph import GradientEdge

from curvopt.graph.checkpointing import reach
from curvopt.graph.search import search
from curvopt.autograd.torch_internals import (
    CONSTANT_PAD,
    MAX_POOL,
    NO_BATCHING_RULE,
    max_pool_transpose,
    pad_transpose,
)


class _Stage:
    """One region: from ``start`` (its root edge ``(node, output_nr)``, the input of the
    max-pool node ``pool``; both ``None`` for the root's), the ``nodes`` autograd reaches from
    ``starts`` without passing a pooling, the poolings it ``meets``, and the indices of the
    asked edges in it (``wanted``)."""

    def __init__(self, pool, start, starts, walk, pools):
        self.pool, self.start = pool, start
        self.nodes, _, entries = reach(starts, pools, walk.next_of, walk.segment_of)
        self.meets = sorted({node for node, _ in entries}, key=id)
        self.wanted: List[int] = []


def pool_stages(root, edges, walk) -> Optional[List[_Stage]]:
    """The stages from ``root`` (a tensor or edge) to ``edges`` across the max-pool (and
    constant-pad) nodes of ``walk`` (``walk.Walk``), each after every stage that feeds it;
    ``None`` where there is no pooling to cross or the stages would not be exact and batched
    (module doc). Made once per walk, root and edges (kept in ``walk.pool_stages``)."""
    node = root.grad_fn if isinstance(root, torch.Tensor) else root.node
    key = (node, root.output_nr, tuple(edges))
    if key not in walk.pool_stages:
        walk.pool_stages[key] = _stages(node, edges, walk)
    return walk.pool_stages[key]


def _stages(node, edges, walk) -> Optional[List[_Stage]]:
    """:func:`pool_stages` from the root node ``node``, made: across the max poolings and the
    constant paddings, or, where a path goes around a padding, across the max poolings alone
    (the paddings' backward then runs batched inside the stages, as ``vmap`` runs it)."""
    pools = {n for n in walk.edges if type(n).__name__ in MAX_POOL}
    others = (n for n in walk.edges if n not in pools)
    if not pools or any(type(n).__name__ in NO_BATCHING_RULE for n in others):
        return None
    pads = {n for n in walk.edges if type(n).__name__ == CONSTANT_PAD}
    return (pads and _crossing(node, edges, walk, pools | pads)) or _crossing(
        node, edges, walk, pools
    )


def _crossing(node, edges, walk, pools) -> Optional[List[_Stage]]:
    """The stages from ``node`` to ``edges`` across the nodes ``pools``, or ``None`` where a
    path goes around one of them."""
    stages = {None: _Stage(None, None, [node], walk, pools)}
    feeders, todo = {}, [None]
    while todo:
        for pool in stages[todo.pop()].meets:
            feeders[pool] = feeders.get(pool, 0) + 1
            if pool not in stages:
                start = walk.next_of(pool)[0]
                starts = [start[0]] if start[0] is not None else []
                stages[pool] = _Stage(pool, start, starts, walk, pools)
                todo.append(pool)
    order, ready = [], [None]
    while ready:  # Kahn: a pooling's stage once every stage meeting it is placed
        stage = stages[ready.pop()]
        order.append(stage)
        for pool in stage.meets:
            feeders[pool] -= 1
            if not feeders[pool]:
                ready.append(pool)
    for j, edge in enumerate(edges):
        for stage in order:
            if edge.node in stage.nodes:
                stage.wanted.append(j)
    for stage in order:
        asked = [edges[j].node for j in stage.wanted] + stage.meets
        if _upstream(stage.meets, walk.next_of).intersection(asked):
            return None  # a path around a pooling: autograd would run it
    return order


def _upstream(pools, nexts) -> set:
    """Every node upstream of the inputs of ``pools``."""
    starts = [fn for pool in pools for fn, _ in nexts(pool)]
    return set(search(starts, lambda node: [fn for fn, _ in nexts(node)]))


def _transpose(node, columns: torch.Tensor) -> torch.Tensor:
    """``J^T`` of a crossed node on ``columns`` ``[k, *out]``: a padding's crop or a max
    pooling's scatter."""
    if type(node).__name__ == CONSTANT_PAD:
        return pad_transpose(node, columns)
    return max_pool_transpose(node, columns)


def across_pools(grad, stages, root, edges, columns):
    """``grad(outputs, inputs, columns, batched)`` (autograd's batched ``J^T``, ``[k, *edge]``
    per input or ``None``) from ``root`` (columns ``[k, *root]``) to ``edges`` in ``stages``
    (:func:`pool_stages`): one batched call per stage, the poolings by their indices. The
    columns arrived at a pooling are let go once its stage has taken them (unless an edge asks
    for them), so a stage holds no earlier stage's columns."""
    result = [None] * len(edges)
    pending = {}  # pooling node -> the columns arrived at its output
    kept = {edge.node for edge in edges}  # poolings whose output an edge asks for
    for stage in stages:
        _run_stage(grad, stage, root, columns, edges, result, pending, kept)
    for j, edge in enumerate(edges):  # an edge into a pooling: all that arrived there
        if edge.node in pending:
            result[j] = pending[edge.node]
    return result


def _run_stage(grad, stage, root, columns, edges, result, pending, kept) -> None:
    """One stage of :func:`across_pools`: its batched call, its edges' columns added into
    ``result`` and those of the poolings it meets into ``pending``."""
    if stage.pool is None:
        roots, cols = [root], [columns]
    else:
        taken = pending.get if stage.pool in kept else pending.pop
        arrived = taken(stage.pool, None)
        if arrived is None or stage.start[0] is None:
            return
        roots, cols = [GradientEdge(*stage.start)], [_transpose(stage.pool, arrived)]
        del arrived
    asks = [edges[j] for j in stage.wanted] + [GradientEdge(p, 0) for p in stage.meets]
    if not asks:
        return
    found = grad(roots, asks, cols, True)
    for j, v in zip(stage.wanted, found):
        if v is not None:
            result[j] = v if result[j] is None else result[j] + v
    for pool, v in zip(stage.meets, found[len(stage.wanted) :]):
        if v is not None:
            old = pending.get(pool)
            pending[pool] = v if old is None else old + v
