"""Averaging (communication): the curvature the optimizer reads, all-reduced over the ranks.

After the backward pass (when ``opt.collect()`` exits) the quantities are flattened into a few
buckets of at most ``bucket_cap`` bytes and all-reduced asynchronously; a bucket is waited for
only when the first parameter in it is read, and the sum divided by the number of ranks ``K``:
the curvature of the objective DDP optimizes, ``(1/K) Σ_k L_k``. What is all-reduced of a
typed value is :func:`~.common.summands`: ``EKFAC``'s ``S`` without its (shared) bases, each
call's factors of a weight used by several calls (a tied embedding and head), whose nearest
Kronecker product is made again from their averages.

Monte-Carlo curvature: inside the collecting block the random generators (CPU, and the CUDA
device of the parameters) are re-seeded with ``seed + rank``, ``seed`` drawn from the global
generator, so the ranks' sampled targets are independent; they are restored afterwards.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from curvopt.core import values

from curvopt.optim.distributed.common import (
    CommStats,
    by_kind,
    control,
    from_summands,
    nbytes,
    summands,
)

Target = tuple[torch.Tensor, str]  # (parameter, attribute)


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


class Averaging:
    """The bucketed, asynchronous averaging of ``(param, attr)`` targets over ``group``."""

    def __init__(self, group, world_size: int, rank: int, bucket_cap: int, stats: CommStats):
        self.group, self.world_size, self.rank = group, world_size, rank
        self.bucket_cap, self.stats = bucket_cap, stats
        self._slots: dict[tuple[int, str], _Slot] = {}
        #: ``(id(param), attr) -> (the attribute's object, its average)``
        self._averaged: dict[tuple[int, str], tuple[Any, Any]] = {}

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
        key, value = (id(param), attr), values.read(param, attr)
        slot = self._slots.get(key)
        return (slot is not None and slot.raw is value) or (
            value is not None and self._averaged.get(key, (None,))[0] is value
        )

    def launch(self, targets: list[Target]) -> None:
        """Start the asynchronous all-reduce of ``param.<attr>`` for all ``targets``.

        All ranks must pass the same targets in the same order. A quantity present on some
        ranks but not on others raises ``RuntimeError`` on every rank.
        """
        targets = [(p, a) for p, a in targets if not self._known(p, a)]
        if not targets:
            return
        found = [values.read(p, attr) for p, attr in targets]
        tensors = [[] if v is None else summands(v) for v in found]
        self._check_presence(targets, found, tensors)
        flat = [t for ts in tensors for t in ts]
        pieces = self._all_reduce(flat)
        it = iter(pieces)
        for (p, attr), value, ts in zip(targets, found, tensors):
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
        control(total, self.group, self.stats)
        present, numel = total.tolist()
        for (p, attr), have, n, mine in zip(targets, present, numel, local[1].tolist()):
            if have not in (0, self.world_size) or n != mine * (have != 0) * self.world_size:
                raise RuntimeError(
                    f"`{attr}` of a parameter of shape {tuple(p.shape)} exists on {have} of "
                    f"{self.world_size} ranks (or differs in size between them), so it cannot be "
                    "averaged. Every rank must run the same model on a batch of the same "
                    "structure inside opt.collect()."
                )

    def _all_reduce(self, tensors: list[torch.Tensor]) -> list[tuple[_Bucket, int, torch.Size]]:
        """Sum ``tensors`` over the ranks in buckets of at most ``bucket_cap`` bytes, launched
        asynchronously; returns ``(bucket, offset, shape)`` for each tensor, in order."""
        pieces: list = [None] * len(tensors)
        for indices in by_kind(tensors).values():
            start = 0
            while start < len(indices):
                stop, size = start, 0
                while stop < len(indices) and (
                    stop == start or size + nbytes(tensors[indices[stop]]) <= self.bucket_cap
                ):
                    size += nbytes(tensors[indices[stop]])
                    stop += 1
                chunk = indices[start:stop]
                buffer = torch.cat([tensors[i].detach().reshape(-1) for i in chunk])
                handle = dist.all_reduce(buffer, group=self.group, async_op=True)
                self.stats.allreduce_calls += 1
                self.stats.allreduce_bytes += nbytes(buffer)
                bucket = _Bucket(buffer, handle, self.world_size, self.stats)
                offset = 0
                for i in chunk:
                    pieces[i] = (bucket, offset, tensors[i].shape)
                    offset += tensors[i].numel()
                start = stop
        return pieces

    def average(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The rank averages of ``tensors`` (every rank passes the same shapes in the same
        order), all-reduced in buckets and waited for: new tensors."""
        return [
            bucket.get()[offset : offset + shape.numel()].view(shape).clone()
            for bucket, offset, shape in self._all_reduce(tensors)
        ]

    def discard(self, param: torch.Tensor, attr: str) -> None:
        """Forget the average of ``param.<attr>`` (not read on this rank: FSDP2's owner of the
        parameter reads it), so that its bucket is freed once the other slots are read."""
        self._slots.pop((id(param), attr), None)
        self._averaged.pop((id(param), attr), None)

    def averaged(self, param: torch.Tensor, attr: str, value):
        """The rank average of ``value = param.<attr>`` (the same type of value), waiting for
        its bucket; ``value`` itself if it was not launched. The attribute is left as the
        backward pass wrote it; a later read of the same object gets the same average."""
        key = (id(param), attr)
        done = self._averaged.get(key)
        if done is not None and done[0] is value:
            return done[1]
        slot = self._slots.get(key)
        if slot is None or slot.raw is not value or value is None:
            return value
        del self._slots[key]
        new_leaves = iter(
            bucket.get()[offset : offset + shape.numel()].view(shape).clone()
            for bucket, offset, shape in slot.pieces
        )
        average = from_summands(value, new_leaves)
        self._averaged[key] = (value, average)
        return average
