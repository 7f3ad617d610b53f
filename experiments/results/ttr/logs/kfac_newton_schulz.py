"""
Exploration (not a grid's run), before ``KFAC(orthogonalize=True)`` existed: issue 53's lever
"Kronecker preconditioning followed by an orthogonalised step" on the GPT, as a stage of its
own here (the library's option computes the same map, ``tests/test_orthogonalize.py``; its
output is kfac_newton_schulz.log). It fixed the grid of ``kfac_ns``. KFAC's `practical` winner setting on the GPT (16 samples'
curvature) with one more stage after momentum: each matrix-shaped direction D (weights as
[out, -1]) is replaced by its orthogonal polar factor, approximated by 5 quintic Newton-Schulz
iterations (Jordan et al. 2024's coefficients 3.4445, -4.7750, 2.0315, on D / ||D||_F),
scaled by sqrt(max(1, out/in)) as torch.optim.Muon's "original" lr adjustment; vectors keep
KFAC's direction. The learning rates are Muon's grid. Seed 0, pruned at 550 steps (Muon's
median). Run from the repository root:

    PYTHONPATH=. OMP_NUM_THREADS=1 python experiments/results/ttr/logs/kfac_newton_schulz.py
"""

from dataclasses import replace

import torch

from curvopt.optim.stages import NEWTON, Stage
from experiments.problems import get_problem
from experiments.ttr.grids import GRIDS
from experiments.ttr.protocol import TTR_PROBLEMS, line, train_to_targets

torch.set_num_threads(1)
COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def polar(matrix: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The quintic Newton-Schulz approximation of ``U V^T`` for ``matrix = U S V^T``."""
    a, b, c = COEFFICIENTS
    x = matrix / (matrix.norm() + 1e-7)
    wide = x.shape[0] <= x.shape[1]
    x = x if wide else x.mT
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x if wide else x.mT


class Orthogonalize(Stage):
    order = 55  # after momentum (50), before the learning rate (60)

    def __call__(self, step) -> None:
        for item in step.params:
            d = item.direction
            if d is None or d.dim() < 2:
                continue
            m = d.reshape(d.shape[0], -1)
            scale = max(1.0, m.shape[0] / m.shape[1]) ** 0.5
            item.direction = (polar(m) * scale).reshape(d.shape)
            item.own = item.direction


P = "fortunes_gpt"
BASE = GRIDS[P]["kfac"][3]  # practical, lr 0.01, damping 0.1, 16 samples' curvature
CHAIN = NEWTON.with_stage(Orthogonalize())
print("base", BASE.label)
spec = TTR_PROBLEMS[P]
splits = get_problem(P).splits(None, False, spec.eval_size, "cpu")
for lr in (0.01, 0.02, 0.05):
    setting = replace(BASE, lr=lr, options=BASE.options + (("stages", CHAIN),))
    print(f"lr {lr}", line(P, train_to_targets(setting, P, spec, splits, 0, prune_at=550)), flush=True)
