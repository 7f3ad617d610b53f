"""The winners' seeds run again, one at a time, at one thread, on an otherwise idle machine:
the wall-clock to the highest target that the protocol's own runs could not give (they ran
beside other jobs). Each run is checked against the steps of its recorded run (the steps are
deterministic per seed, code version and CPU model); the machine's load is recorded beside
each run: the steal share of /proc/stat (CPU taken by the host's other tenants) and the 1-minute
load average.

usage (in experiments/results/ttr, CURVOPT_DATA set):
  python logs/quiet_wall.py fmnist_2c2d:sf_kfac fmnist_2c2d:adam ... > logs/quiet_wall.log
Writes logs/quiet_wall.json (problem -> optimizer -> seeds, each with its whole run) after
every optimizer."""

import json
import os
import sys
import time
from dataclasses import asdict

import torch

from experiments.data import load_dataset, make_splits
from experiments.problems import get_problem
from experiments.ttr.report import median_steps
from experiments.ttr.protocol import GRIDS, TTR_PROBLEMS, line, target_key, train_to_targets

OUT = "logs/quiet_wall.json"


def cpu_jiffies() -> tuple[int, int]:
    """(steal, total) jiffies of all CPUs since boot."""
    fields = [int(v) for v in open("/proc/stat").readline().split()[1:]]
    return fields[7], sum(fields)


torch.set_num_threads(1)
results = json.load(open(OUT)) if os.path.isfile(OUT) else {}
splits_of = {}
for item in sys.argv[1:]:
    problem, opt = item.split(":")
    entry = json.load(open(f"{problem}_{opt}.json"))
    index = entry["winner"]
    setting = GRIDS[problem][opt][index]
    assert setting.as_dict() == entry["tuning"][index]["setting"], (problem, opt)
    spec = TTR_PROBLEMS[problem]
    top = target_key(spec.targets[-1])
    if problem not in splits_of:
        data = load_dataset(get_problem(problem).dataset)
        splits_of[problem] = make_splits(data, eval_size=spec.eval_size)
    seeds = []
    for recorded in sorted(entry["runs"], key=lambda r: r["seed"]):
        steal0, total0 = cpu_jiffies()
        wall0, cpu0 = time.perf_counter(), time.process_time()
        run = train_to_targets(setting, problem, spec, splits_of[problem], recorded["seed"])
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        steal1, total1 = cpu_jiffies()
        same = run.steps_to == recorded["steps_to"]
        seeds.append(
            {
                "same_steps_as_recorded": same,
                "recorded_seconds_to": recorded["seconds_to"],
                "run": asdict(run),
                "process_wall_s": wall,
                "process_cpu_s": cpu,
                "steal_share": (steal1 - steal0) / max(total1 - total0, 1),
                "loadavg_1min_after": os.getloadavg()[0],
            }
        )
        print(line(problem, run), f"same steps: {same}", f"steal {seeds[-1]['steal_share']:.3f}")
        print(f"  process wall {wall:.1f} s, cpu {cpu:.1f} s", flush=True)
    results.setdefault(problem, {})[opt] = {
        "setting": entry["tuning"][index]["setting"],
        "target": spec.targets[-1],
        "median_seconds_to_target": median_steps([s["run"]["seconds_to"][top] for s in seeds]),
        "seeds": seeds,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    json.dump(results, open(OUT, "w"), indent=1)
