"""Curvature optimizers over ``torch.distributed``: one identical step on every rank.

With a ``DistributedDataParallel`` model, every rank backpropagates its own shard of the batch
and DDP averages the gradients. :class:`DistributedCurvature` does the same for the curvature and
splits the expensive linear algebra between the ranks, in three parts:

1. **average** (:mod:`.averaging`, communication) -- after the backward pass the curvature the
   optimizer reads (diagonals, Kronecker factors) is all-reduced in buckets of at most
   ``bucket_cap_mb``, asynchronously; ``opt.step()`` waits for a bucket only when it reads the
   first parameter in it. Monte-Carlo curvature is sampled with per-rank random streams.
2. **spread** (:mod:`.assignment`: which rank computes what, greedy longest-processing-time by
   the cost ``Σ dim³`` of the parameter's factors; :mod:`.spreading`: computing and
   broadcasting) -- each inverse or eigendecomposition that is due is computed on one rank only.
3. **apply** -- every rank then holds the same gradient, curvature and inverses and applies
   the same update, so the replicas stay bit-identical.

:mod:`.common` holds what they share (:class:`CommStats`, flat buffers of nested values).
:mod:`.fsdp` steps FSDP2's sharded parameters (``fully_shard``): the optimizer plans on whole
stand-ins (``FullView``), each rank applies its rows (``local_rows``); with the state kept by
owners (``KFAC``, ``DiagGGNNewton``) each parameter's stand-in is whole on its owner only
(:mod:`.owners`: who owns what, the all-to-alls of rows).
Optimizers use it when ``torch.distributed`` is initialized with more than one rank, or when
given ``process_group=`` (a ``ProcessGroup``, a :class:`DistributedCurvature` for its options,
or ``False`` to stay rank-local). See ``docs/distributed.md``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from curvopt.optim.distributed.assignment import Job, assign_owners, inversion_cost
from curvopt.optim.distributed.averaging import Averaging, Target, draw_seed, rank_rng
from curvopt.optim.distributed.common import CommStats, control, state_nbytes
from curvopt.optim.distributed.spreading import Spreading

__all__ = [
    "CommStats",
    "DistributedCurvature",
    "Job",
    "assign_owners",
    "draw_seed",
    "inversion_cost",
    "rank_rng",
    "resolve",
    "state_nbytes",
]


class DistributedCurvature:
    """Averages curvature across the ranks of ``process_group`` and spreads the inversions.

    Args:
        process_group: the group to average over (default: the default group).
        bucket_cap_mb: largest all-reduce buffer of curvature (as DDP's ``bucket_cap_mb``).

    ``stats`` (:class:`CommStats`) counts the bytes and calls of its collectives.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialized.
        ValueError: ``bucket_cap_mb`` is not positive.

    Example::

        torch.distributed.init_process_group("gloo")  # under torchrun
        opt = curvopt.optim.KFAC(model.parameters(), lr=0.05,
                                 process_group=DistributedCurvature(bucket_cap_mb=50))
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
        self.averaging = Averaging(
            process_group, self.world_size, self.rank, self.bucket_cap, self.stats
        )
        self.spreading = Spreading(process_group, self.world_size, self.rank, self.stats)

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

    # the job protocol the optimizers follow: collect, (ensure), read averaged, spread, mean
    def collecting(self, context, targets: list[Target], sampled: bool):
        """See :meth:`Averaging.collecting`."""
        return self.averaging.collecting(context, targets, sampled)

    def ensure(self, targets: list[Target]) -> None:
        """See :meth:`Averaging.ensure`."""
        self.averaging.ensure(targets)

    def launch(self, targets: list[Target]) -> None:
        """See :meth:`Averaging.launch`."""
        self.averaging.launch(targets)

    def average(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """See :meth:`Averaging.average`."""
        return self.averaging.average(tensors)

    def averaged(self, param: torch.Tensor, attr: str, value):
        """See :meth:`Averaging.averaged`."""
        return self.averaging.averaged(param, attr, value)

    def discard(self, param: torch.Tensor, attr: str) -> None:
        """See :meth:`Averaging.discard`."""
        self.averaging.discard(param, attr)

    def spread(self, jobs: list[Job]) -> list:
        """See :meth:`Spreading.spread`."""
        return self.spreading.spread(jobs)

    def mean(self, value: float) -> float:
        """The mean of a Python number over the ranks (e.g. the change of the loss)."""
        return self.sum([value])[0] / self.world_size

    def sum(self, numbers: list[float]) -> list[float]:
        """The sums of Python numbers over the ranks (float64; every rank the same list)."""
        device = "cuda" if dist.get_backend(self.group) == "nccl" else "cpu"
        tensor = torch.tensor(numbers, dtype=torch.float64, device=device)
        control(tensor, self.group, self.stats)
        return tensor.tolist()


def _restore(bucket_cap_mb: float) -> DistributedCurvature | None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return DistributedCurvature(bucket_cap_mb=bucket_cap_mb)
    return None


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
            "statistics and the replicas would take different steps. Use DiagGGNNewton, KFAC, "
            "EKFAC or VarianceAdaptedSGD, or create it before "
            "torch.distributed.init_process_group / in a single process"
        )
    if isinstance(process_group, DistributedCurvature):
        return process_group
    return DistributedCurvature(process_group)
