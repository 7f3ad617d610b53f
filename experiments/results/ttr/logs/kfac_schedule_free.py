"""
Exploration, 2026-12-02 (before the grid): KFAC `practical` on FMNIST 2C2D, seed 0, with
schedule-free averaging (`schedule_free=0.9`, momentum 0, the `warmup` schedule of schedule-free
AdamW) at several learning rates, with the curvature of 16 samples (`curvature_samples=16`);
each run pruned at 300 steps. Run from the repository root: `PYTHONPATH=. OMP_NUM_THREADS=1 nice
-n 10 python experiments/results/ttr/logs/kfac_schedule_free.py NAME ...`; its output is
kfac_schedule_free.log (the JSONs it wrote to explore were not kept)."""

import json
import sys
from dataclasses import asdict, replace

import torch

from experiments.data import load_dataset, make_splits
from experiments.problems import get_problem
from experiments.ttr.grids import Setting
from experiments.ttr.protocol import TTR_PROBLEMS, line, train_to_targets

torch.set_num_threads(1)
problem, prune = ("fmnist_vit", 500) if sys.argv[1] == "vit" else ("fmnist_2c2d", 300)
names = sys.argv[2:] if sys.argv[1] == "vit" else sys.argv[1:]
spec = TTR_PROBLEMS[problem]
splits = make_splits(load_dataset(get_problem(problem).dataset), eval_size=spec.eval_size)
SF = (("curvature_samples", 16), ("momentum", 0.0), ("schedule_free", 0.9))
SETTINGS = {
    f"sf{lr:g}": Setting("kfac", lr, 0.1, "practical", SF, "warmup", 128)
    for lr in (0.01, 0.03, 0.1, 0.3)
}
SETTINGS.update(
    {
        f"sf{lr:g}_noclip": Setting(
            "kfac", lr, 0.1, "practical", (*SF, ("kl_clip", None)), "warmup", 128
        )
        for lr in (0.03, 0.1, 0.3, 1.0)
    }
)
SETTINGS.update(
    {
        f"sf{lr:g}_clip{clip:g}": Setting(
            "kfac", lr, 0.1, "practical", (*SF, ("kl_clip", clip)), "warmup", 128
        )
        for lr in (0.03, 0.1, 0.3, 1.0, 3.0)
        for clip in (1e-2, 1e-1, 1.0)
    }
)
SETTINGS.update(
    {
        f"sf{lr:g}_clip{clip:g}_beta{beta:g}": Setting(
            "kfac",
            lr,
            0.1,
            "practical",
            (*SF[:2], ("schedule_free", beta), ("kl_clip", clip)),
            "warmup",
            128,
        )
        for lr in (0.3, 1.0)
        for clip in (1e-1, 1.0)
        for beta in (0.95, 0.8)
    }
)
SETTINGS.update(  # no curvature EMA: the factors of one batch, of low rank (Woodbury inverses)
    {
        "sf1_clip1_ema0": Setting(
            "kfac",
            1.0,
            0.1,
            "practical",
            (*SF, ("kl_clip", 1.0), ("curvature_ema", 0.0)),
            "warmup",
            128,
        ),
        "sf1_clip1_ema0_whole": Setting(
            "kfac",
            1.0,
            0.1,
            "practical",
            (*SF[1:], ("kl_clip", 1.0), ("curvature_ema", 0.0)),
            "warmup",
            128,
        ),
    }
)
if problem == "fmnist_vit":  # the raw tokens take the diagonal step; the whole batch's factors
    SETTINGS = {
        name: replace(s, options=(("fallback", "diagonal"), *s.options[1:]))
        for name, s in SETTINGS.items()
    }
for name in names:
    run = train_to_targets(SETTINGS[name], problem, spec, splits, 0, prune)
    print(name, line(problem, run), flush=True)
    json.dump(asdict(run), open(f"explore/{name}.json", "w"))
