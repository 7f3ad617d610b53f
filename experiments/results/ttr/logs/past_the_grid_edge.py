"""
Exploration, 2026-12-02 (not part of the grids): the winners of Adam and schedule-free AdamW on
FMNIST 2C2D and the ViT were at the largest lr of their batch-128 grids; this runs seed 0 at
twice that lr, pruned at the winner's steps to the highest target (a run that does not reach it
sooner cannot win). It is the fairness check for `sf_kfac`, whose grid was set after an
exploration (`kfac_schedule_free.log`). Run from the repository root: `PYTHONPATH=.
OMP_NUM_THREADS=1 nice -n 5 python experiments/results/ttr/logs/past_the_grid_edge.py NAME ...`;
its output is past_the_grid_edge.log."""

import sys

import torch

from experiments.data import load_dataset, make_splits
from experiments.problems import get_problem
from experiments.ttr.grids import Setting
from experiments.ttr.protocol import TTR_PROBLEMS, line, train_to_targets

torch.set_num_threads(1)
RUNS = {  # name: (problem, setting, the winner's steps to the highest target)
    "2c2d_sf_adamw_0.016": (
        "fmnist_2c2d",
        Setting("sf_adamw", 0.016, None, None, (), "warmup", 128),
        250,
    ),
    "2c2d_adam_0.008_wc": (
        "fmnist_2c2d",
        Setting("adam", 0.008, None, None, (), "warmup_cosine", 128),
        525,
    ),
    "vit_sf_adamw_0.008": (
        "fmnist_vit",
        Setting("sf_adamw", 0.008, None, None, (), "warmup", 128),
        625,
    ),
    "vit_adam_0.004_wc": (
        "fmnist_vit",
        Setting("adam", 0.004, None, None, (), "warmup_cosine", 128),
        875,
    ),
}
splits = {}
for name in sys.argv[1:]:
    problem, setting, prune = RUNS[name]
    spec = TTR_PROBLEMS[problem]
    if problem not in splits:
        data = load_dataset(get_problem(problem).dataset)
        splits[problem] = make_splits(data, eval_size=spec.eval_size)
    run = train_to_targets(setting, problem, spec, splits[problem], 0, prune)
    print(name, line(problem, run), flush=True)
