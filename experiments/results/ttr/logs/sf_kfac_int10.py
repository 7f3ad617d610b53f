"""
Check, 2026-12-05 (after the eigendecomposition-aware Woodbury cost model, 9963df6): schedule-free
KFAC's 2C2D grid at batch 128 with the curvature and inverses every 10 steps instead of the
grid's 20, at seed 0, to choose between the two intervals by the grids' own rule (fewest steps
to 0.90 at seed 0, then the least cost per step). Run from the repository root:

    PYTHONPATH=. OMP_NUM_THREADS=1 python experiments/results/ttr/logs/sf_kfac_int10.py I SEED

(``I``: the setting's index in the grid, 0-3). Its output is sf_kfac_int10.log.
"""

import sys
from dataclasses import replace

import torch

from experiments.data import load_dataset, make_splits
from experiments.problems import get_problem
from experiments.ttr.grids import GRIDS
from experiments.ttr.protocol import TTR_PROBLEMS, line, train_to_targets

torch.set_num_threads(1)
PROBLEM = "fmnist_2c2d"
spec = TTR_PROBLEMS[PROBLEM]
splits = make_splits(load_dataset(get_problem(PROBLEM).dataset), eval_size=spec.eval_size)
index, seed = int(sys.argv[1]), int(sys.argv[2])
setting = GRIDS[PROBLEM]["sf_kfac"][index]
every_10 = {"curvature_interval": 10, "inverse_interval": 10}
options = tuple((key, every_10.get(key, value)) for key, value in setting.options)
setting = replace(setting, options=options)
print("int10", line(PROBLEM, train_to_targets(setting, PROBLEM, spec, splits, seed, 300)))
