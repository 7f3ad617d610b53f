"""Step time and communication volume of curvopt's optimizers over ``torch.distributed``.

The DeepOBS FMNIST 2C2D network (conv5x5 32 same + ReLU + maxpool2, conv5x5 64 same + ReLU +
maxpool2, fc 1024 + ReLU, fc 10; 3.27 M parameters) wrapped in ``DistributedDataParallel``;
a global batch of ``--batch`` FMNIST training images (random data of that shape if the IDX files
are not found) split evenly over the ranks. Run with one to K ranks on CPU (gloo)::

    torchrun --nproc_per_node=K benchmarks/distributed_step.py --optimizer kfac

On GPUs (one per rank) pass ``--device cuda`` (NCCL). Rank 0 prints one line per optimizer:
median step time (forward + backward + ``opt.step()``) over the timed steps, its parts, and the
bytes per step that DDP (gradients) and curvopt (curvature, inverses) communicate.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import curvopt
from curvopt.optim import KFAC, DiagGGNNewton

FMNIST_DIRS = ("data/fashion-mnist", "/usr/share/datasets/fashion-mnist")


def two_c_two_d() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(1, 32, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 7 * 7, 1024),
        nn.ReLU(),
        nn.Linear(1024, 10),
    )


def _idx(path: Path) -> np.ndarray:
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    ndim = raw[3]
    shape = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


@functools.lru_cache(maxsize=1)
def _training_set() -> tuple[np.ndarray, np.ndarray, str] | None:
    for folder in map(Path, FMNIST_DIRS):
        images = folder / "train-images-idx3-ubyte.gz"
        labels = folder / "train-labels-idx1-ubyte.gz"
        if images.exists() and labels.exists():
            return _idx(images), _idx(labels), str(folder)
    return None


def fmnist(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, str]:
    """``n`` training images ``[n, 1, 28, 28]`` in [0, 1] and labels, and where they came from
    (random data of that shape if the IDX files are not found)."""
    g = torch.Generator().manual_seed(seed)
    found = _training_set()
    if found is None:
        return (
            torch.rand(n, 1, 28, 28, generator=g),
            torch.randint(0, 10, (n,), generator=g),
            "random",
        )
    images, labels, folder = found
    pick = torch.randperm(len(labels), generator=g)[:n].numpy()
    X = torch.from_numpy(images[pick].astype(np.float32) / 255).unsqueeze(1)
    return X, torch.from_numpy(labels[pick].astype(np.int64)), folder


def make_optimizer(name: str, params):
    if name == "diag":
        return DiagGGNNewton(params, lr=0.01, damping=1e-3, curvature="mc")
    if name == "diag-exact":
        return DiagGGNNewton(params, lr=0.01, damping=1e-3, curvature="exact")
    if name == "kfac":
        return KFAC(params, lr=0.01, damping=1e-3, curvature="kfac")
    if name == "kflr":
        return KFAC(params, lr=0.01, damping=1e-3, curvature="kflr")
    raise ValueError(name)


def run(args, rank: int, world: int, device: torch.device) -> list[dict]:
    rows = []
    for name in args.optimizer:
        torch.manual_seed(0)
        model = curvopt.extend(two_c_two_d().to(device))
        ddp = model
        if world > 1:
            ids = [device.index] if device.type == "cuda" else None
            ddp = nn.parallel.DistributedDataParallel(model, device_ids=ids)
        lossfunc = curvopt.extend(nn.CrossEntropyLoss())
        opt = make_optimizer(name, model.parameters())
        comm = opt._distributed
        grad_bytes = (
            sum(p.numel() * p.element_size() for p in model.parameters()) if world > 1 else 0
        )
        times, backward_times, step_times = [], [], []
        allreduce = broadcast = control = 0
        waits = {"wait_s": [], "inversion_s": [], "broadcast_wait_s": []}
        n = args.batch // world
        for it in range(args.warmup + args.steps):
            X, y, source = fmnist(args.batch, seed=it)
            X, y = X[rank * n : (rank + 1) * n].to(device), y[rank * n : (rank + 1) * n].to(device)
            if comm is not None:
                comm.stats.reset()
            sync(device)
            start = time.perf_counter()
            opt.zero_grad()
            loss = lossfunc(ddp(X), y)
            with opt.collect():
                loss.backward()
            sync(device)
            middle = time.perf_counter()
            opt.step()
            sync(device)
            end = time.perf_counter()
            if it >= args.warmup:
                times.append(end - start)
                backward_times.append(middle - start)
                step_times.append(end - middle)
                if comm is not None:
                    allreduce += comm.stats.allreduce_bytes
                    broadcast += comm.stats.broadcast_bytes
                    control += comm.stats.control_bytes
                    for key, values in waits.items():
                        values.append(getattr(comm.stats, key))
        rows.append(
            {
                "optimizer": name,
                "ranks": world,
                "threads_per_rank": torch.get_num_threads(),
                "batch_per_rank": n,
                "data": source,
                "step_s": statistics.median(times),
                "fwd_bwd_s": statistics.median(backward_times),
                "opt_step_s": statistics.median(step_times),
                "ddp_grad_MB": grad_bytes / 2**20,
                "curv_allreduce_MB": allreduce / args.steps / 2**20,
                "inv_broadcast_MB": broadcast / args.steps / 2**20,
                "control_B": control / args.steps,
                **{key: statistics.median(v) if v else 0.0 for key, v in waits.items()},
                "loss": float(loss.detach()),
            }
        )
    return rows


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--optimizer",
        nargs="+",
        default=["diag", "kfac"],
        choices=["diag", "diag-exact", "kfac", "kflr"],
    )
    parser.add_argument("--batch", type=int, default=128, help="global batch size")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="intra-op threads per rank (default: cores // ranks, at least 1)",
    )
    parser.add_argument("--json", help="append the rows to this JSON-lines file (rank 0)")
    args = parser.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // world))
    rows = run(args, rank, world, device)
    if rank == 0:
        for row in rows:
            print(
                f"{row['optimizer']:>10} ranks={row['ranks']} threads={row['threads_per_rank']} "
                f"N/K={row['batch_per_rank']:>3}  step {row['step_s']:.3f} s "
                f"(fwd+bwd {row['fwd_bwd_s']:.3f}, opt.step {row['opt_step_s']:.3f})  "
                f"DDP grads {row['ddp_grad_MB']:.2f} MB  "
                f"curvature {row['curv_allreduce_MB']:.2f} MB"
                f"  inverses {row['inv_broadcast_MB']:.2f} MB  control {row['control_B']:.0f} B"
                f"  | all-reduce wait {row['wait_s']:.3f} s, own inversions "
                f"{row['inversion_s']:.3f} s, broadcast wait {row['broadcast_wait_s']:.3f} s"
                f"  [{row['data']}]",
                flush=True,
            )
        if args.json:
            with open(args.json, "a") as f:
                for row in rows:
                    f.write(json.dumps(row) + "\n")
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
