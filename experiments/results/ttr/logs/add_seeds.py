"""Add the winner's seeds run alone (logs/one_run.py: logs/parts/<problem>_<opt>_<i>_<seed>.json)
to an entry whose protocol ran with --seeds 1, so that ``ttr --resume`` finds them there.

usage (in experiments/results/ttr): python logs/add_seeds.py fmnist_2c2d sf_adamw 3 1 2"""

import json
import sys

problem, opt, index, seeds = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
path = f"{problem}_{opt}.json"
entry = json.load(open(path))
assert entry["winner"] == index, (entry["winner"], index)
have = {r["seed"] for r in entry["runs"]}
for seed in map(int, seeds):
    run = json.load(open(f"logs/parts/{problem}_{opt}_{index}_{seed}.json"))
    assert run["setting"] == entry["tuning"][index]["setting"] and run["seed"] == seed
    if seed not in have:
        entry["runs"].append(run)
entry["meta"]["seeds_added"] = (
    f"seeds {', '.join(seeds)} by logs/one_run.py, added by logs/add_seeds.py"
)
json.dump(entry, open(path, "w"), indent=1)
print(path, [r["steps_to"] for r in entry["runs"]])
