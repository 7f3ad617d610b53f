"""Assemble fmnist_2c2d_kfac.json from the parallel single runs (logs/one_run.py) and the grid
process's log line for setting 0 seed 0 (that process was stopped; its curve was lost)."""

import json
import sys
from dataclasses import asdict

sys.path.insert(0, ".")
from experiments.ttr.protocol import GRIDS, TTR_PROBLEMS, RunResult, select
from experiments.ttr.report import entry_path, write_json

problem, opt = "fmnist_2c2d", sys.argv[1]
#: setting 0 seed 0 as the grid process logged it: (steps to 0.88, to 0.90, train_s, eval_s)
LOGGED = {"kfac": (150, 775, 1459.3, 56.5), "momentum": (400, 900, 146.9, 41.9)}
spec = TTR_PROBLEMS[problem]
grid = GRIDS[problem][opt]
a, b, train_s, eval_s = LOGGED[opt]
s0 = RunResult(
    grid[0].as_dict(),
    0,
    {"0.88": a, "0.9": b},
    {"0.88": None, "0.9": train_s},
    "reached",
    steps=b,
    train_s=train_s,
    eval_s=eval_s,
)
tuning = [s0]
for i in range(1, len(grid)):
    d = json.load(open(f"logs/parts/{problem}_{opt}_{i}_0.json"))
    tuning.append(RunResult(**d))
best = select(tuning, spec.targets)
runs = [tuning[best]]
for seed in (1, 2):
    path = f"logs/parts/{problem}_{opt}_{best}_{seed}.json"
    try:
        runs.append(RunResult(**json.load(open(path))))
    except FileNotFoundError:
        print("missing", path)
entry = {
    "problem": problem,
    "optimizer": opt,
    "spec": asdict(spec),
    "tuning": [asdict(r) for r in tuning],
    "winner": best,
    "runs": [asdict(r) for r in runs],
    "meta": {
        "threads": 1,
        "synthetic": False,
        "command": f"python -m experiments ttr --problems fmnist_2c2d --optimizers {opt}",
        "assembled": "setting 0 seed 0 from the grid process's log line (run complete, process "
        "stopped before it wrote the file: no curve, no seconds to 0.88); settings 1-3 seed 0 "
        "(pruned at setting 0's steps to 0.90) and the winner's seeds 1-2 as parallel single runs "
        "of experiments.ttr.protocol.train_to_targets (logs/one_run.py), assembled by "
        "logs/assemble_kfac.py with protocol.select",
    },
}
write_json(entry_path("experiments/results/ttr", problem, opt), entry)
print("winner", best, [r.steps_to for r in tuning], [r.steps_to for r in runs])
