"""Curvature optimizers over ``torch.distributed``: one identical step on every rank.

With a ``DistributedDataParallel`` model, every rank backpropagates its own shard of the batch
and DDP averages the gradients. :class:`DistributedCurvature` does the same for the curvature and
splits the expensive linear algebra between the ranks:

1. **average** -- after the backward pass (when ``opt.collect()`` exits) the curvature the
   optimizer reads (diagonals, Kronecker factors) is flattened into a few buckets of at most
   ``bucket_cap_mb`` and all-reduced asynchronously; ``opt.step()`` waits for a bucket only when
   it reads the first parameter in it. The sum is divided by the number of ranks ``K``: the
   curvature of the objective DDP optimizes, ``(1/K) Σ_k L_k``.
2. **spread** -- each inverse or eigendecomposition that is due is computed on one rank only
   (greedy longest-processing-time assignment by the cost ``Σ dim³`` of the parameter's
   factors) and broadcast; one flat buffer per owning rank.
3. **apply** -- every rank then holds the same gradient, curvature and inverses and applies
   the same update, so the replicas stay bit-identical.

Monte-Carlo curvature: inside ``opt.collect()`` the random generators (CPU, and the CUDA device
of the parameters) are re-seeded with ``seed + rank``, ``seed`` drawn from the global generator,
so the ranks' sampled targets are independent; the global generators are restored afterwards.

Optimizers use it when ``torch.distributed`` is initialized with more than one rank, or when
given ``process_group=`` (a ``ProcessGroup``, a :class:`DistributedCurvature` for its options,
or ``False`` to stay rank-local). See ``docs/distributed.md``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = [
    "CommStats",
    "DistributedCurvature",
    "Job",
    "assign_owners",
    "draw_seed",
    "inversion_cost",
    "rank_rng",
    "resolve",
]

Target = tuple[torch.Tensor, str]  # (parameter, attribute)


# ----------------------------------------------------------------------------- pure helpers
def assign_owners(costs: Sequence[float], ranks: int) -> list[int]:
    """The rank computing each job: greedy longest-processing-time balance of ``costs``.

    Jobs are taken from the most to the least expensive (ties: lower index first) and given to
    the rank with the least load so far (ties: lower rank). Deterministic, so every rank computes
    the same assignment.
    """
    loads = [0.0] * ranks
    owners = [0] * len(costs)
    for job in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(ranks), key=lambda r: (loads[r], r))
        owners[job] = rank
        loads[rank] += costs[job]
    return owners


def inversion_cost(curvature) -> float:
    """``Σ dim³`` over Kronecker factors (``numel`` for a diagonal): cost of inverting it."""
    if isinstance(curvature, torch.Tensor):
        return float(curvature.numel())
    return float(sum(f.shape[0] ** 3 for f in curvature))


def _leaves(tree) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    return [leaf for item in tree for leaf in _leaves(item)]


def _rebuild(tree, leaves):
    """``tree``'s structure (tensors in nested lists/tuples) filled with ``leaves`` in order."""
    if isinstance(tree, torch.Tensor):
        return next(leaves)
    return type(tree)(_rebuild(item, leaves) for item in tree)


def _groups(tensors: Sequence[torch.Tensor]) -> dict[tuple, list[int]]:
    """Indices of ``tensors`` by ``(dtype, device)``, in order: one flat buffer each."""
    groups: dict[tuple, list[int]] = {}
    for index, t in enumerate(tensors):
        groups.setdefault((t.dtype, t.device), []).append(index)
    return groups


def draw_seed() -> int:
    """A seed from the global CPU generator (advances it the same way on every rank)."""
    return int(torch.randint(0, 2**62, ()).item())


@contextlib.contextmanager
def rank_rng(seed: int, rank: int, device: torch.device | None = None):
    """Generators of the CPU (and of ``device`` if it is a CUDA device) seeded with
    ``seed + rank`` inside the block, restored to their previous state afterwards."""
    cuda = device is not None and device.type == "cuda"
    devices = []
    if cuda:
        devices = [device.index if device.index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=devices):
        torch.default_generator.manual_seed(seed + rank)
        for index in devices:
            with torch.cuda.device(index):
                torch.cuda.manual_seed(seed + rank)
        yield


# ----------------------------------------------------------------------------- bookkeeping
@dataclass
class CommStats:
    """Payload bytes and calls of the collectives (cumulative; :meth:`reset` to zero)."""

    allreduce_bytes: int = 0  # curvature averaging
    allreduce_calls: int = 0
    broadcast_bytes: int = 0  # inverses / eigendecompositions, total over owners
    broadcast_calls: int = 0
    control_bytes: int = 0  # presence checks, failure flags, loss changes (small)
    control_calls: int = 0
    wait_s: float = 0.0  # time blocked waiting for the asynchronous curvature all-reduces
    inversions: int = 0  # inverses / eigendecompositions computed on this rank
    inversion_s: float = 0.0  # ... and the time they took
    received: int = 0  # ... received from other ranks
    broadcast_wait_s: float = 0.0  # time blocked waiting for the other ranks' inverses

    def reset(self) -> None:
        for name, value in CommStats().__dict__.items():
            setattr(self, name, value)


class _Bucket:
    """A flat buffer being all-reduced (summed); averaged on the first :meth:`get`."""

    def __init__(self, buffer: torch.Tensor, handle, world: int, stats: CommStats):
        self.buffer, self.handle, self.world, self.stats = buffer, handle, world, stats

    def get(self) -> torch.Tensor:
        if self.handle is not None:
            start = time.perf_counter()
            self.handle.wait()
            self.stats.wait_s += time.perf_counter() - start
            self.handle = None
            self.buffer.div_(self.world)
        return self.buffer


@dataclass
class _Slot:
    """Where the average of one ``(param, attr)`` lies: the raw value and its pieces."""

    raw: Any  # the attribute's object as the backward pass wrote it (None: absent everywhere)
    pieces: list[tuple[_Bucket, int, torch.Size]] = field(default_factory=list)


@dataclass
class Job:
    """A quantity derived from a parameter's curvature, to compute on one rank."""

    description: str  # "parameter 'name' (shape ...)", for errors
    compute: Callable[[], Any]  # the value (tensors in nested lists/tuples)
    empty: Callable[[], Any]  # uninitialised tensors of the value's structure (to receive it)
    cost: float


# ----------------------------------------------------------------------------- the component
class DistributedCurvature:
    """Averages curvature across the ranks of ``process_group`` and spreads the inversions.

    Args:
        process_group: the group to average over (default: the default group).
        bucket_cap_mb: largest all-reduce buffer of curvature (as DDP's ``bucket_cap_mb``).

    ``stats`` (:class:`CommStats`) counts the bytes and calls of its collectives.
    """

    def __init__(self, process_group=None, *, bucket_cap_mb: float = 25.0):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "DistributedCurvature needs torch.distributed to be initialized "
                "(torch.distributed.init_process_group) before the optimizer is created"
            )
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
        self.group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.bucket_cap = int(bucket_cap_mb * 2**20)
        self.stats = CommStats()
        self._slots: dict[tuple[int, str], _Slot] = {}
        self._averaged: dict[tuple[int, str], Any] = {}

    def __repr__(self) -> str:
        return (
            f"DistributedCurvature(rank {self.rank} of {self.world_size}, "
            f"bucket_cap_mb={self.bucket_cap / 2**20:g})"
        )

    def __deepcopy__(self, memo) -> DistributedCurvature:
        """A fresh component on the same group (a copied optimizer stays distributed)."""
        return DistributedCurvature(self.group, bucket_cap_mb=self.bucket_cap / 2**20)

    def __reduce__(self):
        """Pickled as "the default group": re-created on loading if ``torch.distributed`` is
        initialized there with more than one rank (else the loaded optimizer is rank-local)."""
        if self.group is not None and self.group is not dist.group.WORLD:
            raise TypeError(
                "an optimizer bound to a non-default process group cannot be pickled; save "
                "opt.state_dict() instead and pass process_group= when re-creating it"
            )
        return _restore, (self.bucket_cap / 2**20,)

    def _src(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    # ------------------------------------------------------------------ collecting
    @contextlib.contextmanager
    def collecting(self, context, targets: list[Target], sampled: bool):
        """``context`` (a ``curvopt.collect``), with per-rank random streams if ``sampled``;
        launches the averaging of ``targets`` when the block exits without error."""
        device = targets[0][0].device if targets else None
        rng = rank_rng(draw_seed(), self.rank, device) if sampled else contextlib.nullcontext()
        with rng, context:
            yield context
        self.launch(targets)

    def ensure(self, targets: list[Target]) -> None:
        """Launch the averaging of the targets whose current value has not been launched yet
        (a backward pass run in ``curvopt.collect`` instead of ``opt.collect()``)."""
        if any(not self._known(p, attr) for p, attr in targets):
            self.launch(targets)

    def _known(self, param, attr) -> bool:
        key, value = (id(param), attr), getattr(param, attr, None)
        slot = self._slots.get(key)
        return (slot is not None and slot.raw is value) or (
            value is not None and self._averaged.get(key) is value
        )

    def launch(self, targets: list[Target]) -> None:
        """Start the asynchronous all-reduce of ``param.<attr>`` for all ``targets``.

        All ranks must pass the same targets in the same order. A quantity present on some
        ranks but not on others raises ``RuntimeError`` on every rank.
        """
        targets = [(p, a) for p, a in targets if not self._known(p, a)]
        if not targets:
            return
        values = [getattr(p, attr, None) for p, attr in targets]
        tensors = [[] if v is None else _leaves(v) for v in values]
        self._check_presence(targets, values, tensors)
        flat = [t for ts in tensors for t in ts]
        pieces = self._all_reduce(flat)
        it = iter(pieces)
        for (p, attr), value, ts in zip(targets, values, tensors):
            self._slots[(id(p), attr)] = _Slot(value, [next(it) for _ in ts])

    def _check_presence(self, targets, values, tensors) -> None:
        """One small all-reduce: every quantity must exist on all ranks or on none, with the
        same number of elements (otherwise the buckets would not line up)."""
        device = targets[0][0].device
        local = torch.tensor(
            [[v is not None for v in values], [sum(t.numel() for t in ts) for ts in tensors]],
            dtype=torch.int64,
            device=device,
        )
        total = local.clone()
        self._control(total)
        present, numel = total.tolist()
        for (p, attr), have, n, mine in zip(targets, present, numel, local[1].tolist()):
            if have not in (0, self.world_size) or n != mine * (have != 0) * self.world_size:
                raise RuntimeError(
                    f"`{attr}` of a parameter of shape {tuple(p.shape)} exists on {have} of "
                    f"{self.world_size} ranks (or differs in size between them), so it cannot be "
                    "averaged. Every rank must run the same model on a batch of the same "
                    "structure inside opt.collect()."
                )

    def _control(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
        dist.all_reduce(tensor, op=op, group=self.group)
        self.stats.control_calls += 1
        self.stats.control_bytes += tensor.numel() * tensor.element_size()

    def _all_reduce(self, tensors: list[torch.Tensor]) -> list[tuple[_Bucket, int, torch.Size]]:
        """Sum ``tensors`` over the ranks in buckets of at most ``bucket_cap`` bytes, launched
        asynchronously; returns ``(bucket, offset, shape)`` for each tensor, in order."""
        pieces: list = [None] * len(tensors)
        for indices in _groups(tensors).values():
            start = 0
            while start < len(indices):
                stop, size = start, 0
                while stop < len(indices) and (
                    stop == start or size + _nbytes(tensors[indices[stop]]) <= self.bucket_cap
                ):
                    size += _nbytes(tensors[indices[stop]])
                    stop += 1
                chunk = indices[start:stop]
                buffer = torch.cat([tensors[i].detach().reshape(-1) for i in chunk])
                handle = dist.all_reduce(buffer, group=self.group, async_op=True)
                self.stats.allreduce_calls += 1
                self.stats.allreduce_bytes += _nbytes(buffer)
                bucket = _Bucket(buffer, handle, self.world_size, self.stats)
                offset = 0
                for i in chunk:
                    pieces[i] = (bucket, offset, tensors[i].shape)
                    offset += tensors[i].numel()
                start = stop
        return pieces

    # ------------------------------------------------------------------ reading
    def averaged(self, param: torch.Tensor, attr: str, value):
        """The rank average of ``value = param.<attr>``, waiting for its bucket; it replaces
        the attribute. ``value`` itself if it was not launched (e.g. already averaged)."""
        key = (id(param), attr)
        slot = self._slots.get(key)
        if slot is None or slot.raw is not value or value is None:
            return value
        del self._slots[key]
        leaves = iter(
            bucket.get()[offset : offset + shape.numel()].view(shape).clone()
            for bucket, offset, shape in slot.pieces
        )
        average = _rebuild(value, leaves)
        setattr(param, attr, average)
        self._averaged[key] = average
        return average

    # ------------------------------------------------------------------ spreading work
    def spread(self, jobs: list[Job]) -> list[Any]:
        """Compute each job on one rank (balanced by cost) and broadcast the results.

        All ranks must pass the same jobs in the same order. For every owning rank in turn, a
        rank posts the (asynchronous) broadcasts of that rank's status and results: receives
        from lower ranks are posted before it computes its own jobs, so they arrive while it
        computes. The values end up in fresh ``empty()`` tensors on every rank, the owner
        included (one memory layout everywhere, so the steps are bit-identical).

        If a job fails on its rank, every rank raises after the exchange
        (``torch.linalg.LinAlgError`` if that is what it raised, else ``RuntimeError``), so no
        rank is left waiting.
        """
        if not jobs:
            return []
        owners = assign_owners([job.cost for job in jobs], self.world_size)
        results = [job.empty() for job in jobs]
        device = _leaves(results[0])[0].device
        handles, copies, statuses, own_error = [], [], [], None
        for src in range(self.world_size):
            mine = [i for i, owner in enumerate(owners) if owner == src]
            if not mine:
                continue
            status = torch.zeros(1, dtype=torch.int64, device=device)
            leaves = [leaf for i in mine for leaf in _leaves(results[i])]
            if src == self.rank:
                start = time.perf_counter()
                computed, code, own_error = self._compute(jobs, mine, results)
                self.stats.inversion_s += time.perf_counter() - start
                status.fill_(code)
            handles.append(self._broadcast(status, src, control=True))
            statuses.append(status)
            for indices in _groups(leaves).values():
                parts = [leaves[i] for i in indices]
                if src == self.rank:
                    buffer = torch.cat(
                        [computed[i].detach().to(parts[0].dtype).reshape(-1) for i in indices]
                    )
                else:
                    buffer = parts[0].new_empty(sum(t.numel() for t in parts))
                handles.append(self._broadcast(buffer, src))
                copies.append((buffer, parts))
        start = time.perf_counter()
        for handle in handles:
            handle.wait()
        self.stats.broadcast_wait_s += time.perf_counter() - start
        codes = [int(status.item()) for status in statuses]
        failed = [code for code in codes if code]
        if failed:
            code = min(failed) - 1  # the first failing job: 2 * index + (1 if LinAlgError)
            job, kind = jobs[code // 2], torch.linalg.LinAlgError if code % 2 else RuntimeError
            if own_error is not None and owners[code // 2] == self.rank:
                if kind is RuntimeError:
                    raise own_error
                raise kind(f"{job.description}: {own_error}") from None
            raise kind(
                f"{job.description}: computing its inverse failed on rank {owners[code // 2]} "
                "(see the error there); no parameter was updated"
            )
        for buffer, parts in copies:
            for part, piece in zip(parts, buffer.split([t.numel() for t in parts])):
                part.copy_(piece.view(part.shape))
        self.stats.received += sum(owner != self.rank for owner in owners)
        return results

    def _compute(self, jobs: list[Job], mine: list[int], results: list[Any]):
        """This rank's jobs: their leaves in order, a status code (0: all done) and the error.

        After a failure the remaining leaves are the (uninitialised) templates, sent anyway so
        that the broadcasts line up.
        """
        values, code, error = [], 0, None
        for i in mine:
            value = results[i]
            if error is None:
                try:
                    value = jobs[i].compute()
                    if [t.shape for t in _leaves(value)] != [t.shape for t in _leaves(results[i])]:
                        raise RuntimeError("the computed value does not have the declared shapes")
                    self.stats.inversions += 1
                except Exception as exc:  # noqa: BLE001 (re-raised on every rank after the exchange)
                    code = 1 + 2 * i + int(isinstance(exc, torch.linalg.LinAlgError))
                    value, error = results[i], exc
            values.append(value)
        return [leaf for value in values for leaf in _leaves(value)], code, error

    def _broadcast(self, tensor: torch.Tensor, src: int, control: bool = False):
        handle = dist.broadcast(tensor, self._src(src), group=self.group, async_op=True)
        if control:
            self.stats.control_calls += 1
            self.stats.control_bytes += _nbytes(tensor)
        else:
            self.stats.broadcast_calls += 1
            self.stats.broadcast_bytes += _nbytes(tensor)
        return handle

    # ------------------------------------------------------------------ scalars
    def mean(self, value: float) -> float:
        """The mean of a Python number over the ranks (e.g. the change of the loss)."""
        device = "cuda" if dist.get_backend(self.group) == "nccl" else "cpu"
        tensor = torch.tensor([value], dtype=torch.float64, device=device)
        self._control(tensor)
        return float(tensor.item()) / self.world_size


def _restore(bucket_cap_mb: float) -> DistributedCurvature | None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return DistributedCurvature(bucket_cap_mb=bucket_cap_mb)
    return None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def resolve(process_group, supported: bool, name: str) -> DistributedCurvature | None:
    """The component an optimizer uses: ``process_group`` is ``None`` (automatic: the default
    group when ``torch.distributed`` is initialized with more than one rank), ``False`` (off),
    a ``ProcessGroup`` or a :class:`DistributedCurvature`.

    Raises ``NotImplementedError`` for an optimizer that does not support it (``supported``),
    since each rank would take a different step.
    """
    if process_group is False:
        return None
    initialized = dist.is_available() and dist.is_initialized()
    if process_group is None and (not initialized or dist.get_world_size() == 1):
        return None
    if not supported:
        raise NotImplementedError(
            f"{name} does not support torch.distributed: it would read each rank's own "
            "statistics and the replicas would take different steps. Use DiagGGNNewton or KFAC, "
            "or create it before torch.distributed.init_process_group / in a single process"
        )
    if isinstance(process_group, DistributedCurvature):
        return process_group
    return DistributedCurvature(process_group)
