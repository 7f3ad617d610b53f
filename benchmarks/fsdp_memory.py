"""Memory of the optimizer's state per rank under FSDP2: kept by each layer's owner, or whole.

The MLP, CNN and two-block GPT (tied head) of ``tests/test_fsdp2.py`` and a wider GPT
(``wide``: vocabulary 512, width 128, 4 heads, 16 tokens), all from ``fixtures.sharded_models``,
are sharded by ``fully_shard`` over K gloo ranks on this machine and stepped by ``KFAC`` (KFLR,
momentum) and ``DiagGGNNewton`` (exact, momentum), float64, a global batch of 8. Each rank
reports after the steps:

* ``state``: bytes of the tensors in its ``opt.state`` (``curvopt.optim.distributed.state_nbytes``),
* ``peak_rss``: the growth of the process's peak resident set from just before the optimizer
  was made to the end of the steps (``ru_maxrss``; each configuration in fresh processes),
* ``alltoall``: bytes it sent by the owners' all-to-alls per step (0 for the whole layout).

``owned`` is the layout curvopt uses (``optim.distributed.fsdp``); ``whole`` the one before it
(every rank the whole state, the same optimizer with ``_owned_state = False``). K = 1 is one
process on the unsharded model. Run::

    OMP_NUM_THREADS=1 python -m benchmarks.fsdp_memory     # the table of docs/distributed.md
    OMP_NUM_THREADS=1 python -m benchmarks.fsdp_memory --models gpt --ranks 4
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import curvopt
from curvopt.optim import KFAC, DiagGGNNewton
from curvopt.optim.distributed import state_nbytes
from fixtures.sharded_models import build, global_batch, rank_shard, shard

STEPS = 3


class WholeKFAC(KFAC):
    """``KFAC`` with the whole state on every rank under FSDP2 (the layout before owners)."""

    _owned_state = False


class WholeDiagGGNNewton(DiagGGNNewton):
    """``DiagGGNNewton`` with the whole state on every rank under FSDP2."""

    _owned_state = False


OPTIMIZERS = {
    "KFAC": (KFAC, WholeKFAC, {"lr": 0.1, "damping": 1e-2, "curvature": "kflr"}),
    "DiagGGNNewton": (DiagGGNNewton, WholeDiagGGNNewton, {"lr": 0.1, "damping": 1e-2}),
}


def measure(rank: int, world: int, name: str, optimizer: str, layout: str) -> dict:
    """One rank's figures for one configuration (K = 1: one process, unsharded)."""
    owned, whole, options = OPTIMIZERS[optimizer]
    make = owned if layout == "owned" else whole
    model = curvopt.extend(build(name))
    if world > 1:
        shard(model, name)
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    X, y = rank_shard(*global_batch(name), rank, world)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    opt = make(model.parameters(), momentum=0.5, **options)
    for _ in range(STEPS):
        opt.zero_grad()
        with opt.collect():
            lossfunc(model(X), y).backward()
        opt.step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    stats = opt._distributed.stats if opt._distributed is not None else None
    return {
        "state": state_nbytes(opt.state),
        "peak_rss": peak * 1024,  # ru_maxrss is in KiB on Linux
        "alltoall": stats.alltoall_bytes / STEPS if stats is not None else 0,
    }


def run(world: int, name: str, optimizer: str, layout: str) -> list[dict]:
    """The figures of every rank of one configuration, each rank a fresh process."""
    with tempfile.TemporaryDirectory() as outdir:
        config = (name, optimizer, layout)
        mp.spawn(_rank, args=(world, outdir, config), nprocs=world, join=True)
        found = []
        for rank in range(world):
            with open(os.path.join(outdir, f"rank{rank}.json")) as f:
                found.append(json.load(f))
        return found


def _rank(rank: int, world: int, outdir: str, config) -> None:
    """One rank: join through a ``FileStore``, measure, write its figures, meet the others
    and leave without tearing gloo down (``os._exit``, as the tests' ranks do)."""
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(outdir, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    found = measure(rank, world, *config)
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(found, f)
    dist.barrier()
    store.set(f"left{rank}", "1")
    store.wait([f"left{r}" for r in range(world)])
    os._exit(0)


def kib(n: float) -> str:
    return f"{n / 1024:.1f} KiB" if n < 2**20 else f"{n / 2**20:.2f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn", "gpt", "wide"])
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS))
    parser.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    args = parser.parse_args()
    print(
        "| model | optimizer | K | layout | state per rank (max) | ratio to K = 1 "
        "| peak RSS growth per rank (max) | all-to-all sent per rank and step (max) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in args.models:
        for optimizer in args.optimizers:
            single = run(1, name, optimizer, "whole")[0]
            print(
                f"| {name} | {optimizer} | 1 | – | {kib(single['state'])} | 1.00 "
                f"| {kib(single['peak_rss'])} | – |"
            )
            for world in args.ranks:
                for layout in ("whole", "owned"):
                    found = run(world, name, optimizer, layout)
                    state = max(r["state"] for r in found)
                    print(
                        f"| {name} | {optimizer} | {world} | {layout} | {kib(state)} "
                        f"| {state / single['state']:.2f} "
                        f"| {kib(max(r['peak_rss'] for r in found))} "
                        f"| {kib(max(r['alltoall'] for r in found))} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
