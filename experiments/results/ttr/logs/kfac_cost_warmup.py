"""KFAC's cost per step on the autoencoder after 1 and after 30 warm-up rounds, with the
damping and ``kl_clip`` of the autoencoder's grids (over 784) and of the other problems'
(the GPT's grid at batch 128): schedule-free KFAC's winner and ``practical`` with 16 samples'
curvature, interleaved by ``experiments.ttr.cost.measure_costs`` (3 counted rounds).

    PYTHONPATH=. OMP_NUM_THREADS=1 python experiments/results/ttr/logs/kfac_cost_warmup.py
"""

from dataclasses import replace

import torch

from experiments.problems import get_problem
from experiments.ttr.cost import measure_costs
from experiments.ttr.grids import GRIDS

torch.set_num_threads(1)
P = "mnist_autoencoder"
SETTINGS = {
    "sf_scaled": GRIDS[P]["sf_kfac"][2],
    "sf_unscaled": replace(GRIDS["fortunes_gpt"]["sf_kfac"][2], batch_size=128),
    "kfac_sub16_scaled": GRIDS[P]["kfac"][3],
    "kfac_sub16_unscaled": replace(GRIDS["fortunes_gpt"]["kfac"][3], batch_size=128),
}
for name, s in SETTINGS.items():
    print(name, s.label)
splits = get_problem(P).splits(None, False, 16, "cpu")
for warmup in (1, 30):
    out = measure_costs(P, SETTINGS, splits, rounds=3, warmup=warmup, log=lambda line: None)
    costs = {n: round(e["per_step_s"] * 1000, 1) for n, e in out["entries"].items()}
    print(f"warmup {warmup} rounds: ms/step (CPU)", costs)
