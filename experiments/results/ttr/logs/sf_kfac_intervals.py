"""
Exploration, 2026-12-05 (before the grid re-run): the curvature's interval and average for the
2C2D winner of schedule-free KFAC at the time (lr 1, damping 0.1, kl_clip 0.1, the curvature of
16 samples, the curvature and inverses every 10 steps, EMA 0.95). Each variant changes one or
two things of it, at seed 0 only (as the grids choose their settings): the EMA (``ema0.8``,
``ema0.9``), the interval (``int5``, ``int20``, ``int40``), both (``int5_ema0.9``,
``int20_ema0.9``), the damping (``d0.03``); and, on the ViT, its winner (lr 0.3) with the
interval 20 (``vit_int20``) against 10 (``vit``). Pruned at 250 steps (2C2D) and 700 (ViT).
The options are spelled out, so the variants mean the same whatever the ``schedule_free``
preset says. Run from the repository root:

    PYTHONPATH=. OMP_NUM_THREADS=1 \
        python experiments/results/ttr/logs/sf_kfac_intervals.py NAME SEED

Its output is sf_kfac_intervals.log.
"""

import sys

import torch

from experiments.data import load_dataset, make_splits
from experiments.problems import get_problem
from experiments.ttr.grids import Setting
from experiments.ttr.protocol import TTR_PROBLEMS, line, train_to_targets

torch.set_num_threads(1)


def intervals(steps):
    return (("curvature_interval", steps), ("inverse_interval", steps))


BASE = (("curvature_samples", 16), ("kl_clip", 0.1), ("curvature_ema", 0.95))
TWO_C_TWO_D = {
    "ema0.8": (1.0, 0.1, BASE[:2] + (("curvature_ema", 0.8),) + intervals(10)),
    "ema0.9": (1.0, 0.1, BASE[:2] + (("curvature_ema", 0.9),) + intervals(10)),
    "int5": (1.0, 0.1, BASE + intervals(5)),
    "int5_ema0.9": (1.0, 0.1, BASE[:2] + (("curvature_ema", 0.9),) + intervals(5)),
    "int20": (1.0, 0.1, BASE + intervals(20)),
    "int20_ema0.9": (1.0, 0.1, BASE[:2] + (("curvature_ema", 0.9),) + intervals(20)),
    "int40": (1.0, 0.1, BASE + intervals(40)),
    "d0.03": (1.0, 0.03, BASE + intervals(10)),
}
VIT_BASE = (("curvature_samples", 16), ("fallback", "diagonal"), ("kl_clip", 0.1))
VIT = {
    "vit": (0.3, 0.1, VIT_BASE + (("curvature_ema", 0.95),) + intervals(10)),
    "vit_int20": (0.3, 0.1, VIT_BASE + (("curvature_ema", 0.95),) + intervals(20)),
}

name, seed = sys.argv[1], int(sys.argv[2])
problem, prune = ("fmnist_vit", 700) if name in VIT else ("fmnist_2c2d", 250)
lr, damping, options = {**TWO_C_TWO_D, **VIT}[name]
spec = TTR_PROBLEMS[problem]
splits = make_splits(load_dataset(get_problem(problem).dataset), eval_size=spec.eval_size)
setting = Setting("sf_kfac", lr, damping, "schedule_free", options, "warmup", 128)
print(name, line(problem, train_to_targets(setting, problem, spec, splits, seed, prune)))
