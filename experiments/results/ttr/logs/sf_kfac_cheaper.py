"""
Exploration, 2026-12-03 (after the grid): cheaper curvature for the 2C2D winner of schedule-free
KFAC at the time (lr 1, kl_clip 1, curvature of 16 samples; ``winner``: the committed one). Each
variant changes one thing of it: the curvature and inverses every 20 steps instead of 10
(``int20``), KFAC-reduce factors for the convolutions (``reduce``), the curvature of 8 samples
(``sub8``). Run from the repository root with ``PYTHONPATH=. OMP_NUM_THREADS=1``:

    python experiments/results/ttr/logs/sf_kfac_cheaper.py steps NAME SEED   # steps to 0.90
    python experiments/results/ttr/logs/sf_kfac_cheaper.py cost ROUNDS WARMUP NAME ...

``cost`` measures the variants interleaved with the committed winner of schedule-free AdamW
(``experiments.ttr.cost.measure_costs``, CPU time at one thread); the output is
sf_kfac_cheaper.log.
"""

import sys
from dataclasses import replace

import torch

from experiments.data import load_dataset, make_splits
from experiments.problems import get_problem
from experiments.ttr.cost import measure_costs
from experiments.ttr.grids import Setting
from experiments.ttr.protocol import TTR_PROBLEMS, line, train_to_targets
from experiments.ttr.report import load_entries, winner_setting

torch.set_num_threads(1)
PROBLEM = "fmnist_2c2d"
WINNERS = {
    e["optimizer"]: winner_setting(e)
    for e in load_entries("experiments/results/ttr")
    if e["problem"] == PROBLEM and e["optimizer"] in ("sf_adamw", "sf_kfac")
}
#: the winner of the 14:18Z tuning (lr 1; since 18:16Z the committed winner is lr 0.3: ``winner``)
BASE = Setting(
    "sf_kfac",
    1.0,
    0.1,
    "schedule_free",
    (("curvature_samples", 16), ("kl_clip", 1.0)),
    "warmup",
    128,
)
CHANGES = {
    "base": {},
    "int20": {"curvature_interval": 20, "inverse_interval": 20},
    "reduce": {"kfac_approx": "reduce"},
    "sub8": {"curvature_samples": 8},
}
VARIANTS = {
    name: replace(BASE, options=tuple({**dict(BASE.options), **change}.items()))
    for name, change in CHANGES.items()
}
VARIANTS["winner"] = WINNERS["sf_kfac"]
spec = TTR_PROBLEMS[PROBLEM]
splits = make_splits(load_dataset(get_problem(PROBLEM).dataset), eval_size=spec.eval_size)
if sys.argv[1] == "steps":
    name, seed = sys.argv[2], int(sys.argv[3])
    run = train_to_targets(VARIANTS[name], PROBLEM, spec, splits, seed)
    print(name, line(PROBLEM, run), flush=True)
else:
    rounds, warmup, names = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
    settings = {"sf_adamw": WINNERS["sf_adamw"], **{n: VARIANTS[n] for n in names}}
    result = measure_costs(PROBLEM, settings, splits, rounds, warmup, log=print)
    adamw = result["entries"]["sf_adamw"]["per_step_s"]
    for name, entry in result["entries"].items():
        ms = 1e3 * entry["per_step_s"]
        print(f"{name}: {ms:.1f} ms CPU per step, {entry['per_step_s'] / adamw:.3f} x sf_adamw")
