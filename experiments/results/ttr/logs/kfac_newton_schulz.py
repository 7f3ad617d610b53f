"""
Exploration (not a grid's run): issue 53's lever "Kronecker preconditioning followed by an
orthogonalised step" on the GPT, which fixed the grid of ``kfac_ns``. KFAC's `practical`
setting with the 16 samples' curvature and ``orthogonalize=True`` (``docs/optim.md``: after
momentum each matrix-shaped step [out, -1] is replaced by its polar factor by five quintic
Newton-Schulz iterations and scaled by sqrt(max(1, out/in)), as torch.optim.Muon's; vectors
keep KFAC's step), at Muon's learning rates 0.01, 0.02 and 0.05 constant, seed 0, pruned at
550 steps (Muon's median). Its log, kfac_newton_schulz.log, is of its first version, which
ran the same map as a stage of its own before the option existed (same steps at lr 0.02 as
the grid's run, logs/kfac_ns_gpt.log). Run from the repository root:

    PYTHONPATH=. OMP_NUM_THREADS=1 python experiments/results/ttr/logs/kfac_newton_schulz.py
"""

from dataclasses import replace

import torch

from experiments.problems import get_problem
from experiments.ttr.grids import GRIDS
from experiments.ttr.protocol import TTR_PROBLEMS, line, train_to_targets

torch.set_num_threads(1)
P = "fortunes_gpt"
BASE = GRIDS[P]["kfac"][3]  # practical, lr 0.01, damping 0.1, 16 samples' curvature
print("base", BASE.label)
spec = TTR_PROBLEMS[P]
splits = get_problem(P).splits(None, False, spec.eval_size, "cpu")
for lr in (0.01, 0.02, 0.05):
    setting = replace(BASE, lr=lr, options=BASE.options + (("orthogonalize", True),))
    print(f"lr {lr}", line(P, train_to_targets(setting, P, spec, splits, 0, prune_at=550)))
