"""``torch.distributed`` (torchrun) for the runner: ranks, devices, sharded batches.

Under ``torch.distributed`` with more than one rank (``torchrun --nproc_per_node=K``, see
:func:`init_distributed`), every rank trains a replica on its ``batch_size / K`` slice of each
global mini-batch (:func:`shard`). With one process nothing of this is involved.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .optimizers import SetupError

#: Offset between the ranks' seeds of the global generators (dropout, Monte-Carlo curvature).
RANK_SEED_STRIDE = 1_000_003


@dataclass(frozen=True)
class DistInfo:
    """Where this process stands in ``torch.distributed`` (one rank of one when not in use)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def active(self) -> bool:
        return self.world_size > 1

    @property
    def main(self) -> bool:
        return self.rank == 0


def dist_info() -> DistInfo:
    """The default process group if it is initialized with more than one rank, else one rank."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        rank = dist.get_rank()
        return DistInfo(rank, dist.get_world_size(), int(os.environ.get("LOCAL_RANK", rank)))
    return DistInfo()


def _rank_device(device: str, local_rank: int) -> torch.device:
    """The device of one rank: CUDA devices are ``cuda:LOCAL_RANK``."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev
    if not torch.cuda.is_available():
        raise SetupError(f"device {device!r} requested but torch sees no CUDA device")
    if dev.index is not None and dev.index != local_rank:
        raise SetupError(
            f"device {device!r}: under torchrun every rank uses cuda:LOCAL_RANK (here "
            f"cuda:{local_rank}); pass --device cuda (or auto)"
        )
    if local_rank >= torch.cuda.device_count():
        raise SetupError(
            f"local rank {local_rank} needs cuda:{local_rank}, but torch sees only "
            f"{torch.cuda.device_count()} CUDA device(s); start at most that many processes "
            "per node"
        )
    return torch.device("cuda", local_rank)


def init_distributed(device: str = "auto") -> bool:
    """Initialize the default process group when started by ``torchrun`` with ``WORLD_SIZE`` > 1.

    The backend is NCCL when the rank's device (see :func:`resolve_device`) is a CUDA device,
    else gloo; rank, world size and rendezvous come from torchrun's environment. Returns whether
    it initialized the group (the caller then calls ``torch.distributed.destroy_process_group``).
    Does nothing for one process or when the group is already initialized.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or (dist.is_available() and dist.is_initialized()):
        return False
    if not dist.is_available():
        raise SetupError("WORLD_SIZE > 1 but this torch build has no torch.distributed")
    dev = _rank_device(device, int(os.environ.get("LOCAL_RANK", "0")))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return True


def from_main(obj):
    """Rank 0's ``obj`` on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def check_distributable(cfg, info: DistInfo) -> None:
    """``SetupError`` if the run ``cfg`` (a ``RunConfig``) cannot run on ``info``'s ranks."""
    if not info.active:
        return
    if cfg.batch_size % info.world_size:
        raise SetupError(
            f"batch size {cfg.batch_size} is not divisible by the {info.world_size} ranks: each "
            "rank trains on batch_size / K samples of every global batch; choose --batch-size or "
            "--nproc_per_node so that K divides it"
        )


def shard(batches, info: DistInfo):
    """This rank's contiguous slice of each global batch."""
    for x, y in batches:
        n = len(y) // info.world_size
        lo, hi = info.rank * n, (info.rank + 1) * n
        yield x[lo:hi], y[lo:hi]


def resolve_device(device: str) -> torch.device:
    """``device`` as a ``torch.device``; under torchrun with K > 1, CUDA means cuda:LOCAL_RANK."""
    info = dist_info()
    if info.active:
        return _rank_device(device, info.local_rank)
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SetupError(f"device {device!r} requested but torch sees no CUDA device")
    return dev
