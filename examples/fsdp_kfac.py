"""KFAC on an FSDP2 (``fully_shard``) model: every rank its shard of the batch and of the weights.

Run with ``torchrun`` (gloo, on CPUs)::

    torchrun --standalone --nproc_per_node 2 examples/fsdp_kfac.py --steps 20

or without it, spawning the ranks on this machine's CPUs (gloo)::

    python examples/fsdp_kfac.py --spawn 2 --steps 20

The model is sharded (``fully_shard`` on each block and on the root), then extended; the
optimizer holds the sharded ``DTensor`` parameters. Each step the backward pass writes the
Kronecker factors of the rank's samples on them, ``opt.step()`` averages the factors over the
ranks; each layer's owner rank keeps its factors and inverses and computes its whole direction,
and every rank applies its rows of each direction to its shard (``docs/distributed.md#fsdp2``).
Rank 0 prints the loss of the global batch and, at the end, the bytes each rank holds: its
parameter shard and its part of the optimizer's state.
"""

from __future__ import annotations

import argparse
import gc
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.fsdp import fully_shard

import curvopt
from curvopt.optim import KFAC
from curvopt.optim.distributed import state_nbytes

BATCH = 64  # the global batch, split evenly over the ranks
#: the optimizer's options (KFLR: exact factors, the same on every rank's average)
OPTIONS = {"lr": 0.3, "damping": 1e-2, "curvature": "kflr", "momentum": 0.5}


def make_model() -> nn.Sequential:
    """A four-layer MLP (the same initial weights on every rank)."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(32, 64), nn.Tanh()) for _ in range(1)]
    blocks.append(nn.Sequential(nn.Linear(64, 64), nn.Tanh()))
    return nn.Sequential(*blocks, nn.Linear(64, 10))


def global_batch(step: int):
    """Step ``step``'s global batch of a fixed random teacher (the same on every rank)."""
    g = torch.Generator().manual_seed(1000 + step)
    X = torch.randn(BATCH, 32, generator=g)
    teacher = torch.randn(32, 10, generator=torch.Generator().manual_seed(7))
    return X, (X @ teacher).argmax(1)


def shard_bytes(p: torch.Tensor) -> int:
    """Bytes of the rank's shard of a parameter."""
    local = p.to_local() if hasattr(p, "to_local") else p
    return local.numel() * local.element_size()


def train(steps: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    if BATCH % world:
        raise SystemExit(f"the batch of {BATCH} does not split over {world} ranks")
    model = make_model()
    for block in model[:2]:
        fully_shard(block)
    fully_shard(model)
    curvopt.extend(model)  # before fully_shard works too (see docs/distributed.md#fsdp2)
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    opt = KFAC(model.parameters(), **OPTIONS)
    n = BATCH // world
    for step in range(steps):
        X, y = global_batch(step)
        X, y = X[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]
        opt.zero_grad()
        with opt.collect():
            loss = lossfunc(model(X), y)
            loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0 and (step % 5 == 0 or step == steps - 1):
            print(f"step {step:3d}  loss {float(mean) / world:.4f}")
    shard = sum(shard_bytes(p) for p in model.parameters())
    state = state_nbytes(opt.state)
    sizes = torch.tensor([shard, state], dtype=torch.float64)
    everyone = [torch.zeros_like(sizes) for _ in range(world)]
    dist.all_gather(everyone, sizes)
    if rank == 0:
        for r, (p_bytes, s_bytes) in enumerate(everyone):
            print(
                f"rank {r}: parameter shard {p_bytes / 1024:.1f} KiB, "
                f"optimizer state {s_bytes / 1024:.1f} KiB"
            )
    del model, opt
    gc.collect()  # the FSDP2 modules go while the process group is alive


def run(rank: int, world: int, port: int, steps: int) -> None:
    """One rank (``--spawn``): join the group on this machine, train, leave."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        train(steps)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--spawn", type=int, default=0, help="spawn this many gloo ranks")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.spawn:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(run, args=(args.spawn, port, args.steps), nprocs=args.spawn, join=True)
        return
    if "RANK" not in os.environ:
        raise SystemExit("run it under torchrun, or with --spawn K (see the docstring)")
    dist.init_process_group("gloo")
    try:
        train(args.steps)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
