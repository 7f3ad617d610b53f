"""Cost per step of the 2C2D winners of Adam, schedule-free AdamW and SOAP, interleaved in one
process (``experiments.ttr.cost.measure_costs``), written beside the logs so that the committed
``cost.json`` (measured on a quiet machine) stays as it is. Ratios between the entries are what
count on a shared machine (CPU time at one thread). Arguments: ROUNDS WARMUP OUT.json."""

import json
import sys

import torch

from experiments.data import load_dataset, make_splits
from experiments.ttr.cost import measure_costs
from experiments.ttr.report import load_entries, winner_setting

rounds, warmup, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.set_num_threads(1)
entries = load_entries("experiments/results/ttr")
winners = {
    e["optimizer"]: winner_setting(e)
    for e in entries
    if e["problem"] == "fmnist_2c2d" and e["optimizer"] in ("adam", "sf_adamw", "soap")
}
splits = make_splits(load_dataset("fmnist", "data"), eval_size=1)
result = measure_costs("fmnist_2c2d", winners, splits, rounds, warmup, log=print)
with open(out, "w") as f:
    json.dump(result, f, indent=1)
for name, entry in result["entries"].items():
    ratio = entry["per_step_s"] / result["entries"]["adam"]["per_step_s"]
    print(f"{name}: {1e3 * entry['per_step_s']:.1f} ms CPU per step, {ratio:.2f} x Adam")
