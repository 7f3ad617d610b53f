"""The table of logs/quiet_wall.json: per problem and optimizer, the steps to the highest target
per seed (and whether they are the recorded runs' steps), the training wall-clock to it, its
median and ratio to Adam's, and the estimate from cost.json (median steps x interleaved CPU
cost per step) beside it; the most steal any run saw.

usage (in experiments/results/ttr): python logs/quiet_wall_table.py > quiet_wall.md"""

import json

from experiments.ttr.protocol import target_key
from experiments.ttr.report import median_steps

wall = json.load(open("logs/quiet_wall.json"))
costs = json.load(open("cost.json"))["problems"]


def cell(value, fmt):
    return "-" if value is None else fmt.format(value)


print(
    "| problem | optimizer | target | steps per seed (re-run) | same as the recorded runs | "
    "median steps | wall-clock s to the target per seed | median wall s | ratio to Adam (wall) "
    "| est. s = median steps × CPU cost | ratio to Adam (est.) | most steal in a run |"
)
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for problem, entries in wall.items():
    rows = {}
    for opt, entry in entries.items():
        key = target_key(entry["target"])
        runs = [s["run"] for s in entry["seeds"]]
        steps = [r["steps_to"][key] for r in runs]
        cost = costs[problem]["entries"][opt]["per_step_s"]
        steps_mid = median_steps(steps)
        rows[opt] = {
            "target": entry["target"],
            "steps": steps,
            "same": all(s["same_steps_as_recorded"] for s in entry["seeds"]),
            "steps_mid": steps_mid,
            "wall": [r["seconds_to"][key] for r in runs],
            "wall_mid": entry["median_seconds_to_target"],
            "est": None if steps_mid is None else steps_mid * cost,
            "steal": max(s["steal_share"] for s in entry["seeds"]),
        }
    ref = rows.get("adam")
    for opt, r in rows.items():
        ratio_wall = ref and r["wall_mid"] and ref["wall_mid"] and r["wall_mid"] / ref["wall_mid"]
        ratio_est = ref and r["est"] and ref["est"] and r["est"] / ref["est"]
        print(
            f"| {problem} | {opt} | {r['target']:g} "
            f"| {', '.join(cell(s, '{}') for s in r['steps'])} "
            f"| {'yes' if r['same'] else 'no'} | {cell(r['steps_mid'], '{:g}')} "
            f"| {', '.join(cell(w, '{:.1f}') for w in r['wall'])} "
            f"| {cell(r['wall_mid'], '{:.1f}')} "
            f"| {cell(ratio_wall, '{:.2f}')} | {cell(r['est'], '{:.1f}')} "
            f"| {cell(ratio_est, '{:.2f}')} | {r['steal']:.3f} |"
        )
