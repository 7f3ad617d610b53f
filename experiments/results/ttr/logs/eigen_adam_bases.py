"""
Exploration after the grids' runs (not part of any grid, so not in the benchmark's tables): the
autoencoder's EigenAdam winner (lr 8e-3, warm-up + cosine, basis every 10 steps) with cheaper
eigenbases, to see what its cost per step is made of: ``dim512`` leaves the sides wider than
512 unrotated (``max_basis_dim=512``: the 784- and 1000-wide ones), ``int50`` refreshes the
bases every 50 steps, ``dim512_int50`` both. Steps to the targets at seeds 0-2 (pruned at
400); the runs' own wall-clock per step is a rough cost (the interleaved measurement, with
blocks of 50 steps for a basis every 50, took too long for the session and was dropped).
Run from the repository root:

    PYTHONPATH=. OMP_NUM_THREADS=1 python experiments/results/ttr/logs/eigen_adam_bases.py

Its output is eigen_adam_bases.log.
"""

from dataclasses import replace

import torch

from experiments.problems import get_problem
from experiments.ttr.grids import GRIDS
from experiments.ttr.protocol import TTR_PROBLEMS, line, train_to_targets

torch.set_num_threads(1)
P = "mnist_autoencoder"
WINNER = GRIDS[P]["eigen_adam"][3]
VARIANTS = {
    "dim512": replace(WINNER, options=WINNER.options + (("max_basis_dim", 512),)),
    "int50": replace(WINNER, options=(("basis_interval", 50),)),
    "dim512_int50": replace(WINNER, options=(("basis_interval", 50), ("max_basis_dim", 512))),
}
print("winner", WINNER.label)
spec = TTR_PROBLEMS[P]
splits = get_problem(P).splits(None, False, spec.eval_size, "cpu")
for name, setting in VARIANTS.items():
    for seed in (0, 1, 2):
        print(name, line(P, train_to_targets(setting, P, spec, splits, seed, prune_at=400)))
