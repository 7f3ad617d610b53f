"""Per-pass time of 2C2D's ``KFLR`` (``--quantity``, ``--problem``: another one) at
multiples of the column budget (``curvature._COLUMN_BUDGET``), interleaved round by round in
one process.

    OMP_NUM_THREADS=1 python -m benchmarks.kflr_column_budget [--rounds 16] [--quantity Q]

Each call's input-side Kronecker factor is computed once per pass (``engine.kron_pass``), so
larger chunks of columns should buy no time; the budget then sets the peak memory alone
(measured by ``python -m experiments overhead --memory``). DeepOBS 2C2D (Fashion-MNIST shapes)
at its benchmark batch (``experiments.overhead.problems``), float32, one thread; each entry is
the median over rounds, in milliseconds, with the plain forward + backward pass for scale.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import curvopt
import curvopt.engine.curvature as curvature
from curvopt import extensions as ext
from experiments.overhead.problems import PROBLEMS

MULTIPLES = (0.25, 0.5, 1, 2, 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--quantity", default="KFLR", help="a second-order extension's name")
    parser.add_argument("--problem", default="2c2d", choices=sorted(PROBLEMS))
    args = parser.parse_args()
    extension = getattr(ext, args.quantity)
    torch.set_num_threads(1)
    model, x, y, lossfunc = PROBLEMS[args.problem].build()
    model, lossfunc = curvopt.extend(model), curvopt.extend(lossfunc)
    budget = curvature._COLUMN_BUDGET

    def step(multiple):
        model.zero_grad()
        curvature._COLUMN_BUDGET = int(budget * multiple)
        loss = lossfunc(model(x), y)
        start = time.perf_counter()
        if multiple:
            with curvopt.collect(extension()):
                loss.backward()
        else:
            loss.backward()
        return 1e3 * (time.perf_counter() - start)

    cases = (0, *MULTIPLES)  # 0: the plain backward
    times = {case: [] for case in cases}
    for case in cases:
        step(case)  # warm-up, and the structure's plan
    for r in range(args.rounds):
        for case in cases if r % 2 else cases[::-1]:
            times[case].append(step(case))
    curvature._COLUMN_BUDGET = budget
    print(f"| budget | {args.quantity} backward (ms, median) |")
    print("|---|---|")
    for case in cases:
        label = "plain backward" if case == 0 else f"{case}x"
        print(f"| {label} | {statistics.median(times[case]):.0f} |")


if __name__ == "__main__":
    main()
