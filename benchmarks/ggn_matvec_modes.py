"""Exact GGN matvecs ``G v`` of ``linalg.GGN``: forward mode (``J v`` by ``jvp``) against the
reverse-over-reverse path and curvlinops 3.0.1's ``GGNLinearOperator``, on the overhead problems.

    OMP_NUM_THREADS=1 python -m benchmarks.ggn_matvec_modes [--problems 2c2d gpt 3c3d]
        [--rounds 15] [--batch N]

Interleaved rounds (each round runs every step in a fresh random order; a step's time is the
fastest of ``--reps`` consecutive calls), so that the ratios compare steps under the same load.
Printed per problem: the median time of each step, its median ratio to a plain forward (no
grad) of the same round ("forwards": the cost in forward-equivalents), and the medians of the
per-round ratios forward mode / reverse and forward mode / curvlinops. The three products are
checked to agree first.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import curvopt
from curvopt import linalg
from experiments.overhead.backends import CurvlinopsBackend, Instance, probe_vector
from experiments.overhead.cases import QUANTITIES
from experiments.overhead.problems import PROBLEMS


def steps(problem) -> dict[str, callable]:
    """The steps of one problem, each on its own copy; checks that the products agree."""
    plain = Instance.of(problem)

    def forward():
        with torch.no_grad():
            plain.model(plain.X)

    def forward_backward():
        plain.model.zero_grad(set_to_none=True)
        plain.lossfunc(plain.model(plain.X), plain.y).backward()

    operators = {}
    for mode in ("forward mode", "reverse"):
        inst = Instance.of(problem)
        G = linalg.GGN(
            curvopt.extend(inst.model), curvopt.extend(inst.lossfunc), [(inst.X, inst.y)]
        )
        G.products.forward_mode = mode == "forward mode"
        operators[mode] = G
    v = probe_vector(plain.model).numpy()
    curvlinops = CurvlinopsBackend().make_step(Instance.of(problem), QUANTITIES["GGN_matvec"])
    results = {name: G @ v for name, G in operators.items()}
    results["curvlinops"] = curvlinops().numpy()
    scale = np.abs(results["reverse"]).max()
    for name, result in results.items():
        error = np.abs(result - results["reverse"]).max() / scale
        if error > 1e-4:
            raise AssertionError(f"{problem.name}: {name} differs from reverse by {error:.2e}")
    if not operators["forward mode"].products.forward_mode:
        raise AssertionError(f"{problem.name}: forward mode fell back to reverse")
    return {
        "forward": forward,
        "forward+backward": forward_backward,
        "forward mode": lambda: operators["forward mode"] @ v,
        "reverse": lambda: operators["reverse"] @ v,
        "curvlinops": curvlinops,
    }


def best_of(step, reps: int) -> float:
    best = math.inf
    for _ in range(reps):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return best


def measure(problem, rounds: int, reps: int, seed: int = 0) -> str:
    named = steps(problem)
    for step in named.values():
        step()  # warm-up
    times = {name: [] for name in named}
    order = list(named)
    rng = random.Random(seed)
    with sdpa_kernel(SDPBackend.MATH):  # the same attention kernel for every step
        for _ in range(rounds):
            rng.shuffle(order)
            for name in order:
                times[name].append(best_of(named[name], reps))

    def ratio(a, b):
        return statistics.median(x / y for x, y in zip(times[a], times[b]))

    lines = [f"{problem.name} (N={problem.batch_size}), {rounds} rounds:"]
    for name in named:
        ms = 1e3 * statistics.median(times[name])
        lines.append(f"  {name:17s} {ms:9.2f} ms  {ratio(name, 'forward'):6.2f} forwards")
    lines.append(
        f"  forward mode / reverse {ratio('forward mode', 'reverse'):.2f}, "
        f"forward mode / curvlinops {ratio('forward mode', 'curvlinops'):.2f}, "
        f"reverse / curvlinops {ratio('reverse', 'curvlinops'):.2f}"
    )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", nargs="+", default=["2c2d", "gpt"])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--reps", type=int, default=2, help="calls per sample (the fastest)")
    parser.add_argument("--batch", type=int, help="batch size (default: the problem's)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), float32, cpu")
    for name in args.problems:
        problem = PROBLEMS[name]
        if args.batch:
            problem = problem.resized(args.batch)
        print(measure(problem, args.rounds, args.reps), flush=True)


if __name__ == "__main__":
    main()
