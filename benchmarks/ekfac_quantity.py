"""Time of EKFAC's ``S`` on FMNIST 2C2D's fc1 (``Linear(3136, 1024)``) at batch 128, one thread:
the quantity (``LayerRule.eigen_correction``: rotated inputs and output gradients, no per-sample
gradient) against ``BatchGrad`` + rotation (``batch_grad`` materialised ``[N, 1024, 3136]``,
then ``Q_Bᵀ G_n Q_A`` per sample, what ``optim.EKFAC`` did before the quantity existed).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/ekfac_quantity.py [--rounds 3] [--old-rounds 1]

Both run on the same call (random inputs and output gradients) in the same random orthogonal
basis, in float32, after one warm-up each; the table shows the median over rounds, and the
largest relative difference of the two ``S`` (they are the same number up to rounding).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from curvopt.layers import rule_for
from curvopt.layers.eigenbasis import eigen_moment_of
from curvopt.core.calls import Call


def _timed(fn, rounds):
    fn()  # warm-up
    times, value = [], None
    for _ in range(rounds):
        start = time.perf_counter()
        value = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--old-rounds", type=int, default=1, help="BatchGrad + rotation: slow")
    parser.add_argument("--batch", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    fc1 = nn.Linear(7 * 7 * 64, 1024)
    x = torch.randn(args.batch, fc1.in_features)
    g = torch.randn(args.batch, fc1.out_features) / args.batch
    call = Call(fc1, (x,), {}, g)
    rule = rule_for(fc1)
    bases = [torch.linalg.qr(torch.randn(d, d))[0] for d in (fc1.out_features, fc1.in_features)]

    new, s_new = _timed(lambda: rule.eigen_correction(call, "weight", bases), args.rounds)
    old, s_old = _timed(
        lambda: eigen_moment_of(rule.batch_grad(call, "weight"), bases), args.old_rounds
    )
    gap = float(((s_new - s_old).abs() / s_old.abs().max()).max())
    print(f"fc1 {fc1.out_features}x{fc1.in_features}, N={args.batch}, float32, 1 thread")
    print(f"  EKFAC quantity (eigen_correction)   {1e3 * new:10.1f} ms")
    print(f"  BatchGrad + rotation                {1e3 * old:10.1f} ms")
    print(f"  speed-up {old / new:.0f}x; largest difference / max |S|: {gap:.1e}")


if __name__ == "__main__":
    main()
