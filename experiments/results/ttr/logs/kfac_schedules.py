"""
Exploration, 2026-12-02 (not part of the grid): KFAC `practical` on FMNIST 2C2D, seed 0, with the
warm-up + cosine schedule at three learning rates and with the eigenbasis damping; each run
pruned at 300 steps (the whole-batch practical setting reaches 0.90 at 300). Run from the
repository root: `PYTHONPATH=. OMP_NUM_THREADS=1 nice -n 10 python
experiments/results/ttr/logs/kfac_schedules.py wc02 wc01 wc04 eigh_wc02`; its output is
kfac_schedules.log (the JSONs it wrote to explore were not kept)."""
import json
import sys
from dataclasses import asdict
import torch
from experiments.data import load_dataset, make_splits
from experiments.problems import get_problem
from experiments.ttr.protocol import TTR_PROBLEMS, train_to_targets, line
from experiments.ttr.grids import Setting

torch.set_num_threads(1)
problem = "fmnist_2c2d"
spec = TTR_PROBLEMS[problem]
splits = make_splits(load_dataset(get_problem(problem).dataset), eval_size=spec.eval_size)
SETTINGS = {
    "wc02": Setting("kfac", 0.02, 0.1, "practical", (), "warmup_cosine", 128),
    "wc01": Setting("kfac", 0.01, 0.1, "practical", (), "warmup_cosine", 128),
    "wc04": Setting("kfac", 0.04, 0.1, "practical", (), "warmup_cosine", 128),
    "eigh_wc02": Setting(
        "kfac",
        0.02,
        0.1,
        "practical",
        (("kronecker_damping", "trace_norm_eigh"), ("inverse_interval", 100)),
        "warmup_cosine",
        128,
    ),
}
for name in sys.argv[1:]:
    run = train_to_targets(SETTINGS[name], problem, spec, splits, 0, 300)
    print(name, line(problem, run), flush=True)
    json.dump(asdict(run), open(f"explore/{name}.json", "w"))
