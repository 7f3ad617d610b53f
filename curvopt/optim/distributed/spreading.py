"""Spreading: each due inverse or eigendecomposition computed on one rank (by
:func:`~curvopt.optim.distributed.assignment.assign_owners`) and broadcast to all, so every
rank holds the same inverses and applies the same update (the replicas stay bit-identical)."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from curvopt.optim.distributed.assignment import Job, assign_owners
from curvopt.optim.distributed.common import CommStats, by_kind, leaves, nbytes


class Spreading:
    """Computes jobs on their owning ranks of ``group`` and broadcasts the results."""

    def __init__(self, group, world_size: int, rank: int, stats: CommStats):
        self.group, self.world_size, self.rank, self.stats = group, world_size, rank, stats

    def _src(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

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
        device = leaves(results[0])[0].device
        handles, copies, statuses, own_error = [], [], [], None
        for src in range(self.world_size):
            mine = [i for i, owner in enumerate(owners) if owner == src]
            if not mine:
                continue
            status = torch.zeros(1, dtype=torch.int64, device=device)
            parts_of = [leaf for i in mine for leaf in leaves(results[i])]
            if src == self.rank:
                start = time.perf_counter()
                computed, code, own_error = self._compute(jobs, mine, results)
                self.stats.inversion_s += time.perf_counter() - start
                status.fill_(code)
            handles.append(self._broadcast(status, src, control=True))
            statuses.append(status)
            for indices in by_kind(parts_of).values():
                parts = [parts_of[i] for i in indices]
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
                    if [t.shape for t in leaves(value)] != [t.shape for t in leaves(results[i])]:
                        raise RuntimeError("the computed value does not have the declared shapes")
                    self.stats.inversions += 1
                except Exception as exc:  # noqa: BLE001 (re-raised on every rank after the exchange)
                    code = 1 + 2 * i + int(isinstance(exc, torch.linalg.LinAlgError))
                    value, error = results[i], exc
            values.append(value)
        return [leaf for value in values for leaf in leaves(value)], code, error

    def _broadcast(self, tensor: torch.Tensor, src: int, control: bool = False):
        handle = dist.broadcast(tensor, self._src(src), group=self.group, async_op=True)
        if control:
            self.stats.control_calls += 1
            self.stats.control_bytes += nbytes(tensor)
        else:
            self.stats.broadcast_calls += 1
            self.stats.broadcast_bytes += nbytes(tensor)
        return handle
