"""Time of one training step of curvopt's optimizers relative to SGD with momentum.

    PYTHONPATH=. .venv/bin/python benchmarks/optim_steps.py                 # the issue's table
    PYTHONPATH=. .venv/bin/python benchmarks/optim_steps.py --problems mnist_logreg --rounds 10
    PYTHONPATH=. .venv/bin/python benchmarks/optim_steps.py --profile fmnist_2c2d:kfac
    PYTHONPATH=. .venv/bin/python benchmarks/optim_steps.py --problems fmnist_2c2d --threads 1 \
        --optimizers kfac ekfac ekfac_basis10 --rounds 3 --block 2    # EKFAC beside KFAC

A step is ``zero_grad``, forward, loss, backward inside ``opt.collect()``, ``opt.step()`` on a
fixed random batch (DeepOBS networks of ``experiments/problems.py``, batch 128 by default).
Every optimizer works on its own copy of the network. A sample of one optimizer is the mean
time of ``--block`` consecutive steps (10 by default, so that ``kfac_interval10``'s curvature
and inverses, computed every 10 steps, are amortised exactly as in training); each round runs
every optimizer's sample in a shuffled order and divides by SGD's sample of the same round. The
table shows the median ratio over rounds and SGD's median time per step.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see experiments/overhead/__main__.py

import torch
from torch import nn

import curvopt
from experiments.problems import fmnist_2c2d, mnist_logreg

#: networks and their input shape (10 classes each)
NETWORKS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "fmnist_2c2d": (fmnist_2c2d, (1, 28, 28)),
    "mnist_logreg": (mnist_logreg, (1, 28, 28)),
}


def _sgd(params):
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)


def _diagggn_mc(params):
    return curvopt.optim.DiagGGNNewton(params, lr=1e-3, damping=1e-2, curvature="mc")


def _kfac(params):
    return curvopt.optim.KFAC(params, lr=1e-3, damping=1e-2)


def _kfac_interval10(params):
    return curvopt.optim.KFAC(
        params, lr=1e-3, damping=1e-2, curvature_interval=10, inverse_interval=10
    )


def _ekfac(params):
    return curvopt.optim.EKFAC(params, lr=1e-3, damping=1e-2)


def _ekfac_basis10(params):
    return curvopt.optim.EKFAC(params, lr=1e-3, damping=1e-2, basis_interval=10)


#: optimizer factories; ``sgd`` is the baseline of every ratio
OPTIMIZERS: dict[str, Callable] = {
    "sgd": _sgd,
    "diagggn_mc": _diagggn_mc,
    "kfac": _kfac,
    "kfac_interval10": _kfac_interval10,
    "ekfac": _ekfac,
    "ekfac_basis10": _ekfac_basis10,
}

#: the issue's goals (ratio to SGD with momentum, batch 128, 2 threads)
GOALS: dict[tuple[str, str], float] = {
    ("fmnist_2c2d", "diagggn_mc"): 1.6,
    ("fmnist_2c2d", "kfac"): 5.0,
    ("fmnist_2c2d", "kfac_interval10"): 2.0,
    ("mnist_logreg", "diagggn_mc"): 3.0,
    ("mnist_logreg", "kfac"): 8.0,
}


@dataclass
class Trainer:
    """One optimizer on its own copy of a network, with a fixed batch."""

    model: nn.Module
    lossfunc: nn.Module
    opt: torch.optim.Optimizer
    X: torch.Tensor
    y: torch.Tensor

    @classmethod
    def build(cls, network: str, optimizer: str, batch: int, seed: int = 0) -> Trainer:
        make, shape = NETWORKS[network]
        torch.manual_seed(seed)
        model, lossfunc = make(), nn.CrossEntropyLoss()
        if optimizer != "sgd":
            model, lossfunc = curvopt.extend(model), curvopt.extend(lossfunc)
        gen = torch.Generator().manual_seed(seed + 1)
        X = torch.randn(batch, *shape, generator=gen)
        y = torch.randint(10, (batch,), generator=gen)
        return cls(model, lossfunc, OPTIMIZERS[optimizer](model.parameters()), X, y)

    def step(self) -> None:
        self.opt.zero_grad()
        loss = self.lossfunc(self.model(self.X), self.y)
        collect = getattr(self.opt, "collect", None)
        if collect is None:
            loss.backward()
        else:
            with collect():
                loss.backward()
        self.opt.step()

    def block(self, steps: int) -> float:
        """Mean seconds per step over ``steps`` consecutive steps."""
        start = time.perf_counter()
        for _ in range(steps):
            self.step()
        return (time.perf_counter() - start) / steps


def measure(
    network: str, optimizers: list[str], batch: int, rounds: int, block: int, seed: int = 0
) -> dict[str, list[float]]:
    """Per optimizer, the ratio of its block time to SGD's in each interleaved round, plus
    ``"sgd_ms"``: SGD's time per step in each round."""
    trainers = {name: Trainer.build(network, name, batch) for name in ["sgd", *optimizers]}
    for trainer in trainers.values():
        trainer.block(block)  # warm-up: buffers, caches, first curvature
    ratios: dict[str, list[float]] = {name: [] for name in trainers}
    ratios["sgd_ms"] = []
    order = list(trainers)
    rng = random.Random(seed)
    for _ in range(rounds):
        rng.shuffle(order)
        gc.collect()
        gc.disable()
        try:
            times = {name: trainers[name].block(block) for name in order}
        finally:
            gc.enable()
        for name, t in times.items():
            ratios[name].append(t / times["sgd"])
        ratios["sgd_ms"].append(1e3 * times["sgd"])
    return ratios


def profile(network: str, optimizer: str, batch: int, steps: int = 10, rows: int = 20) -> str:
    """torch.profiler table (self CPU time by op) of ``steps`` steps of one optimizer."""
    from torch.profiler import profile as torch_profile

    trainer = Trainer.build(network, optimizer, batch)
    trainer.block(3)
    with torch_profile(record_shapes=True) as prof:
        trainer.block(steps)
    table = prof.key_averages(group_by_input_shape=True).table(
        sort_by="self_cpu_time_total", row_limit=rows
    )
    return f"{steps} steps of {optimizer} on {network}, batch {batch}\n{table}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--problems", nargs="+", default=list(NETWORKS), choices=list(NETWORKS))
    p.add_argument(
        "--optimizers",
        nargs="+",
        default=[o for o in OPTIMIZERS if o not in ("sgd", "ekfac", "ekfac_basis10")],
        choices=[o for o in OPTIMIZERS if o != "sgd"],
    )
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--block", type=int, default=10, help="steps per sample (default 10)")
    p.add_argument("--profile", metavar="NETWORK:OPTIMIZER")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.profile:
        network, optimizer = args.profile.split(":")
        print(profile(network, optimizer, args.batch))
        return 0
    print(
        f"step time / SGD-momentum step time (median over {args.rounds} interleaved rounds of "
        f"{args.block} steps each); batch {args.batch}, torch.set_num_threads("
        f"{torch.get_num_threads()}), OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}\n"
    )
    print("| network | SGD ms/step | " + " | ".join(args.optimizers) + " |")
    print("|---|---|" + "---|" * len(args.optimizers))
    for network in args.problems:
        ratios = measure(network, args.optimizers, args.batch, args.rounds, args.block)
        cells = []
        for name in args.optimizers:
            cell = f"{statistics.median(ratios[name]):.2f}"
            goal = GOALS.get((network, name))
            if goal is not None:
                cell += f" (≤ {goal:g} {'✓' if statistics.median(ratios[name]) <= goal else '✗'})"
            cells.append(cell)
        sgd = statistics.median(ratios["sgd_ms"])
        print(f"| {network} | {sgd:.2f} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
