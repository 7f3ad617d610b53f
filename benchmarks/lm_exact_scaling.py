"""How curvopt's exact curvature on a language model scales with the vocabulary V and the
sequence length T, against the floor of :mod:`experiments.overhead.floors`.

    OMP_NUM_THREADS=1 python -m benchmarks.lm_exact_scaling [--batch 2] [--reps 3]
        [--vocab 64 256] [--seq 8 16 32] [--quantities KFLR DiagGGNExact]

The GPT-style decoder of ``fixtures/zoo.py`` (d = 64, 4 heads, one block, tied output layer) at
each (V, T); per cell the median over ``--reps`` of the extended step's time, the plain step's
time, the floor's GFLOP and ms (calibrated in this process) and measured extra / floor.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import curvopt
from experiments.overhead import floors
from experiments.overhead.cases import QUANTITIES
from experiments.overhead.problems import Problem, _next_tokens, gpt


def _median_time(step, reps: int) -> float:
    step()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _row(q: str, V: int, T: int, batch: int, reps: int, cal: floors.Calibration) -> str:
    """One table row: quantity ``q`` on the decoder with vocabulary ``V``, ``T`` positions."""
    build = lambda: gpt(vocab=V, seq_len=T)
    problem = Problem(f"gpt_V{V}_T{T}", "", build, _next_tokens(T, V), batch)
    model, X, y, lossfunc = problem.build()

    def plain():
        model.zero_grad(set_to_none=True)
        lossfunc(model(X), y).backward()

    plain_s = _median_time(plain, reps)
    ext_model, ext_loss = curvopt.extend(model), curvopt.extend(lossfunc)
    extension = QUANTITIES[q].extensions[0]()

    def step():
        ext_model.zero_grad(set_to_none=True)
        loss = ext_loss(ext_model(X), y)
        with curvopt.collect(extension):
            loss.backward()

    step_s = _median_time(step, reps)
    f = floors.floor(problem, q)
    ms = f.ms(cal)
    return (
        f"| {q} | {V} | {T} | {1e3 * plain_s:.1f} | {1e3 * step_s:.0f} | "
        f"{f.flops / 1e9:.2f} | {ms:.1f} | {(1e3 * (step_s - plain_s)) / ms:.1f} |"
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--vocab", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--seq", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--quantities", nargs="+", default=["KFLR", "DiagGGNExact"])
    args = parser.parse_args(argv)
    cal = floors.calibrate()
    print(
        f"torch.set_num_threads({torch.get_num_threads()}), N = {args.batch}, sgemm "
        f"{cal.flops_per_s / 1e9:.0f} GFLOP/s, copy {cal.bytes_per_s / 1e9:.0f} GB/s\n"
    )
    print("| quantity | V | T | plain ms | step ms | floor GFLOP | floor ms | measured/floor |")
    print("|---|---|---|---|---|---|---|---|")
    for q in args.quantities:
        for V in args.vocab:
            for T in args.seq:
                print(_row(q, V, T, args.batch, args.reps, cal), flush=True)


if __name__ == "__main__":
    main()
