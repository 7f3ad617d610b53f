"""How one group of extensions' columns reach the module calls: a strategy, chosen from the walk.

``curvature.CurvaturePass`` makes the loss's square-root columns (``curvature.LossColumns``)
and hands them, with a ``contribute(calls, outs)`` callback, to the strategy of the group
(extensions that share a source of columns); the strategy propagates them and calls back with
the columns at every call's outputs, as often as its chunks need:

* :class:`Direct`: chunks of columns within the memory budget, packed by slot, each through
  ``propagate.to_calls`` from the loss input to every call at once (``V = J^T S``);
* ``compress.HeadCut``: the exact columns of a language model in two stages around the input
  ``h`` of its head, ``d`` per row below it instead of ``V`` (``compress``); it falls back to
  its :class:`Direct` where the probe columns show, on this pass, that the map from the loss
  input to ``h`` is not row-local.

:func:`choose` picks the strategy once per group and pass, from the walk: a cut is looked for
(``compress.find_cut``) only for the exact columns of a loss with one row dimension where some
position-wise call's input is narrower than a row's columns; whether one was found is kept in
the walk's plan (``core.plans.Plan.cuts``, by the loss input's shape, the columns per row and
whether diagonals are asked). A structure where none was found is not searched again (the
direct path is exact whatever the graph); one where a cut was found has it found again, on this
pass's nodes, with every condition of ``find_cut`` checked again, and ``HeadCut`` probes the
rows on every pass before any column goes.

The other special cases of propagation are chosen where the columns cross the graph, from the
walk, not here (``propagate``'s module doc): reentrant checkpoints (``walk.Walk.segmented``:
``checkpointing.through``, its stages kept per root while the re-run segments live), max
pooling (its batched stages made once per walk, root and edges asked, ``pooling``) and
broadcast calls (bound on their records by the walk, their positions in the plan, read by
``propagate.to_calls``).
"""

from __future__ import annotations

import torch

from curvopt.engine.compress import HeadCut, find_cut
from curvopt.core.plans import add_cut
from curvopt.graph.propagate import to_calls


class Direct:
    """The columns in chunks (as many as fit ``columns.fit(calls)``), each from the loss input
    to every call of ``calls`` in one ``propagate.to_calls``."""

    def __init__(self, calls, batched: bool, walk):
        self.calls, self.batched, self.walk = calls, batched, walk

    def propagate(self, columns, contribute) -> None:
        calls = self.calls
        for cols in columns.packed(columns.fit(calls)):
            # (no name holds a chunk's propagated columns while the next one's are made)
            outs = to_calls(columns.root, calls, cols, self.batched, self.walk)
            contribute(calls, outs)
            del outs, cols


def choose(walk, calls, columns, batched: bool, diagonals: bool):
    """The strategy for ``columns`` (``curvature.LossColumns``) to ``calls`` of ``walk``:
    ``compress.HeadCut`` where a cut is found (module doc), else :class:`Direct`;
    ``diagonals``: diagonal quantities are asked (a weight tied across the cut forbids it)."""
    direct = Direct(calls, batched, walk)
    if columns.source != "exact" or columns.layout.row_dims != 1:
        return direct
    root, total = columns.root, columns.per_row()
    key = (tuple(root.shape), total, diagonals)
    known = None if walk.plan is None else dict(walk.plan.cuts).get(key)
    if known is False:
        return direct
    cut = find_cut(walk, calls, root, diagonals) if _narrower(calls, total) else None
    if cut is not None and total <= cut.width:
        cut = None  # no fewer columns below the head than in a row
    if known is None:
        add_cut(walk, key, cut is not None)
    return direct if cut is None else HeadCut(cut, calls, batched, walk, direct)


def _narrower(calls, total: int) -> bool:
    """Whether a position-wise call's input is narrower than the loss's ``total`` exact columns
    per row: only there can columns be compressed (``compress``; the cut is such an input)."""
    return any(
        record.positionwise
        and record.args
        and isinstance(record.args[0], torch.Tensor)
        and record.args[0].shape[-1] < total
        for record in calls
    )
