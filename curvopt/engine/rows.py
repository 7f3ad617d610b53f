"""Which rows of the loss input belong to which sample of the model: the packing of columns.

A square-root factor ``S [K, R, *F]`` of the loss Hessian covers the ``R`` rows of the loss input
(``logits.reshape(-1, C)`` has ``R = N T`` rows for a batch of ``N`` sequences). Propagating one
column ``S[k]`` for all rows at once gives, at a module seeing ``N`` samples,
``g_n = sum_{r -> n} J_rn^T s_rk``: exact per-sample terms only if no two rows of the column
reach the same sample. ``core.layouts.RowLayout`` maps each row to the one sample it depends on
(``sample[r]``) and packs the rows into slots whose rows reach distinct samples; the engine
propagates ``S[k] * [slot(r) == s]`` for every ``(k, s)``: ``K * num_slots`` columns, where
``num_slots = max_n |{r : sample[r] = n}|`` (``1`` for the K-dim form ``[N, C, T...]``).

The map comes from the shapes (``R == N``: row ``r`` is sample ``r``; ``R == N T``: batch-first
``r // T`` or sequence-first ``r % N``) and is verified by probes: each sample gets its own code
of ``k // 2`` ones out of ``k`` bits (``probe_sets``), and probe ``j``, a random vector on the
rows of the samples whose bit ``j`` is ``1``, propagated to every module output, must vanish on
the samples whose bit ``j`` is ``0``. No code covers another, so for any two samples ``s != m``
some probe holds ``s``'s rows and not ``m``'s: these ``k`` columns (``k`` the least with
``C(k, k // 2) >= N``: 8 for ``N = 64``, 5 for ``N = 8``; two per bit, ``2 ceil(log2 N)``, would
be 12 and 6), propagated one at a time (the probes' memory is that of one column, whatever
``N``: a structure's first pass peaks no higher than a pass of one Monte-Carlo column), catch
any row that depends on a sample other than its own:
functional batch norm or ``h - h.mean(0)`` between layers, a sequence-first model read as
batch-first, layers that disagree on the batch. Verified layouts are kept in the plan of the
graph's structure (``core.plans.Plan.layouts``, with the calls found transposed), so the probes
run once per model and input shape; graphs that index by data (``logits[mask]``) have no plan
and are probed on every pass.
"""

from __future__ import annotations

import itertools
import math
from typing import Dict, List, Optional

import torch

from curvopt.errors import UnsupportedModuleError, batch_mismatch, module_error
from curvopt.core.layouts import RowLayout
from curvopt.core.plans import add_layout
from curvopt.layers import mixing, rule_for
from curvopt.graph.propagate import to_calls

#: probe columns per propagation: the probes' memory (one column: the first pass of a
#: structure, which runs them, then peaks no higher than the later passes of ``KFAC``)
_PROBES_PER_CALL = 1


def batch_sizes(calls) -> Dict[object, int]:
    """Samples seen by each module call (along its rule's batch dim of its first output)."""
    return {record: record.batch_size for record in calls}


def model_batch(calls) -> Optional[int]:
    """The batch size all module calls agree on; raises naming a module that disagrees."""
    sizes = batch_sizes(calls)
    if not sizes or len(set(sizes.values())) == 1:
        return next(iter(sizes.values()), None)
    first, *records = sorted(sizes, key=lambda r: r.seq)
    for record in records:
        if sizes[record] != sizes[first]:
            raise batch_mismatch(record.module, record.batch_dim, sizes[record], sizes[first])
    return sizes[first]


def align(calls) -> List[object]:
    """Sequence-first models: a positionwise call (Linear, LayerNorm, Embedding) whose output
    ``[T, N, ...]`` has the batch of the calls with a fixed batch dim (``MultiheadAttention
    (batch_first=False)``, convolutions, ...) on dim 1 is marked ``transposed``. Returns the
    calls for which dims 0 and 1 both fit (``T == N``): the probes decide those."""

    def flexible(record):
        shape = record.out_shapes[0]
        return record.positionwise and record.broadcast is None and len(shape) >= 3

    anchors = {record.batch_size for record in calls if not flexible(record)}
    if len(anchors) != 1:
        return []
    (n,) = anchors
    ambiguous = []
    for record in filter(flexible, calls):
        shape = record.out_shapes[0]
        if shape[0] != n and shape[1] == n:
            record.transposed = True
        elif shape[0] == n == shape[1]:
            ambiguous.append(record)
    return ambiguous


def _fits(rows: int, n: int) -> bool:
    """Whether the shapes suggest a map of ``rows`` rows onto ``n`` samples (``_candidates``)."""
    return n == 1 or rows <= n or rows % n == 0


def _candidates(rows: int, n: int, device) -> List[torch.Tensor]:
    if not _fits(rows, n):
        return []
    index = torch.arange(rows, device=device)
    if n == 1:
        return [torch.zeros_like(index)]
    if rows <= n:
        return [index]  # one row per sample (rows < n: the first ``rows`` samples, out[:k])
    per = rows // n
    return [index // per, index % n]  # batch-first [N, T] -> N T, sequence-first [T, N] -> T N


def establish(
    source,
    shape,
    calls,
    batched: bool,
    walk,
    elementwise: bool = False,
    required: bool = True,
    coupled: bool = False,
) -> Optional[RowLayout]:
    """The verified layout of the rows of ``source`` (a tensor or gradient edge of ``shape``)
    over the samples of ``calls`` (of ``walk``, a ``walk.Walk`` from ``source``, whose
    plan keeps it); raises when no candidate map passes the probes.

    Rows are dim 0; where the Hessian is ``elementwise`` (independent entries, so dim 1 holds
    independent units too) also the pairs of dims 0 and 1 (a sequence-first ``[T, N, D]``).
    Not ``required`` (a check only): ``None`` when the shapes suggest no map at all. A call
    mixing samples (``mixing``) raises its rule's reason, but in a ``coupled`` pass (nothing
    per sample, ``curvature``) the shapes' map is taken unverified.
    """
    mixer = mixing(calls)
    if mixer is not None and not coupled:  # rows map onto no one sample
        raise module_error(mixer.module, rule_for(mixer.module).check(mixer.module))
    if mixer is not None:
        return _shaped(shape, calls)
    wanted = (tuple(shape), elementwise)  # ``(found,)`` where a layout was looked for before
    known = () if walk.plan is None else [f for k, f in walk.plan.layouts if k == wanted][:1]
    records = list(calls)
    cached = bool(known)
    if cached:
        (found,) = known
        for index in () if found is None else found[2]:
            records[index].transposed = True
    else:
        ambiguous = align(calls)
    n = model_batch(calls)
    if not required and not _any_candidate(shape, n, elementwise):
        return None
    if not cached:
        found = _verified(source, shape, calls, batched, walk, n, elementwise)
        if found is None and ambiguous:  # T == N: the batch may be dim 1 of those calls
            for record in ambiguous:
                record.transposed = True
            found = _verified(source, shape, calls, batched, walk, n, elementwise)
        if found is not None:  # the layout itself kept too: a fact of the structure
            transposed = tuple(i for i, r in enumerate(records) if r.transposed)
            found = (*found, transposed, RowLayout(found[1], n, found[0]))
        add_layout(walk, shape, elementwise, found)
    if found is None:
        raise UnsupportedModuleError(
            f"curvopt cannot tell which of the {shape[0]} loss rows belong to which of the {n} "
            "samples: an op between the layers mixes samples, or the rows are in an unusual "
            "order. Keep samples independent and give the loss [N, C, ...] or rows of "
            "[N, T, C] or [T, N, C]; see docs/support.md#loss-rows-and-samples."
        )
    return found[3]


def _shaped(shape, calls) -> RowLayout:
    """The map of rows onto samples the shapes suggest (a coupled pass's, unverified)."""
    align(calls)
    n, rows = model_batch(calls), torch.arange(shape[0], device=next(iter(calls)).device)
    return RowLayout((rows // max(1, shape[0] // n)).clamp_max(n - 1), n)


def _row_dims(shape, elementwise):
    return (1, 2) if elementwise and len(shape) > 1 else (1,)


def _any_candidate(shape, n, elementwise) -> bool:
    return any(_fits(math.prod(shape[:d]), n) for d in _row_dims(shape, elementwise))


def _verified(source, shape, calls, batched, walk, n, elementwise) -> Optional[tuple]:
    """``(row_dims, sample)`` of the first candidate map that passes the probes."""
    device = next(iter(calls)).device
    for row_dims in _row_dims(shape, elementwise):
        rows = math.prod(shape[:row_dims])
        for sample in _candidates(rows, n, device):
            if _passes(source, shape, calls, batched, walk, sample, n, row_dims):
                return row_dims, sample
    return None


def reaches_own_samples(source, shape, calls, batched, walk, layout: RowLayout) -> bool:
    """Whether the probes (module doc) on the rows ``layout`` maps to each sample reach that
    sample alone at the outputs of ``calls``: the check of :func:`establish` for calls added
    after it (``engine.parameter_sites``)."""
    return _passes(
        source, shape, calls, batched, walk, layout.sample, layout.samples, layout.row_dims
    )


def _passes(source, shape, calls, batched, walk, sample, n, row_dims) -> bool:
    """Probe columns (see module doc) vanish where the map says they must; propagated
    ``_PROBES_PER_CALL`` at a time, so that the columns held at every module output stay few
    whatever ``N``."""
    if n == 1 or not calls:
        return True
    gen = torch.Generator(device=sample.device).manual_seed(0)
    dtype = next(iter(calls)).dtype
    sets = probe_sets(n).to(sample.device).T  # [k, N]
    for first in range(0, len(sets), _PROBES_PER_CALL):
        keep = sets[first : first + _PROBES_PER_CALL]  # samples that may be nonzero in each
        # noise [k, *shape], zeroed off each probe's samples in place (no copies beside it)
        masks = keep.to(dtype)[:, sample].reshape(len(keep), *shape[:row_dims])
        probes = torch.randn((len(keep), *shape), generator=gen, dtype=dtype, device=sample.device)
        probes.mul_(masks.reshape(*masks.shape, *([1] * (len(shape) - row_dims))))
        if _leaks(to_calls(source, calls, probes, batched, walk), keep, n):
            return False
    return True


def probe_sets(n: int) -> torch.Tensor:
    """``[N, k]`` bool: sample ``m`` is in probe set ``j``. Each sample has its own code of
    ``k // 2`` ones, ``k`` the least with ``C(k, k // 2) >= N``; as no code covers another,
    for any two samples ``s != m`` some set holds ``s`` and not ``m``."""
    k = 1
    while math.comb(k, k // 2) < n:
        k += 1
    codes = itertools.islice(itertools.combinations(range(k), k // 2), n)
    return torch.tensor([[j in ones for j in range(k)] for ones in codes], dtype=torch.bool)


def _leaks(outs, keep, n) -> bool:
    """Some probe column (``outs``: ``to_calls``'s, ``[k, ...]`` per output) is nonzero on a
    sample outside its ``keep`` (``[k, N]`` bool)."""
    allowed = keep[:, :, None]
    for record, columns in outs.items():
        dims = rule_for(record.module).output_batch_dims(record.module, len(columns))
        for v, dim in zip(columns, dims):
            if v is None or v.dim() <= 1 + dim or v.shape[1 + dim] != n:
                continue
            v = v.movedim(1 + dim, 1).reshape(len(keep), n, -1)
            if bool(((v != 0) & ~allowed).any()):
                return True
    return False
