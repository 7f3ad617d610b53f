"""Drop from an entry the runs whose optimizer averages its curvature (``curvature_ema`` > 0),
so that ``ttr --resume`` trains them again and reuses the others: after a change that moves
only the averaged-curvature code path (31c7e57: an average of rooted factors kept as its root
alone, the same matrix with another float32 rounding).

usage (in experiments/results/ttr): python logs/drop_averaged_runs.py fmnist_2c2d kfac"""

import json
import sys

from experiments.optimizers import resolve_options

problem, opt = sys.argv[1], sys.argv[2]
path = f"{problem}_{opt}.json"
entry = json.load(open(path))


def averaged(run: dict) -> bool:
    s = run["setting"]
    return resolve_options(s["optimizer"], s["preset"], s["options"]).get("curvature_ema", 0) > 0


for key in ("tuning", "runs"):
    dropped = [r["setting"] for r in entry[key] if averaged(r)]
    entry[key] = [r for r in entry[key] if not averaged(r)]
    print(path, key, "dropped", len(dropped), "kept", len(entry[key]))
json.dump(entry, open(path, "w"), indent=1)
