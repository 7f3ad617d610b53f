"""One run of the ttr protocol (grid setting index, seed).

Writes logs/parts/<problem>_<opt>_<i>_<seed>.json."""

import json
import sys
from dataclasses import asdict
import torch
from experiments.data import load_dataset, make_splits
from experiments.problems import get_problem
from experiments.ttr.protocol import GRIDS, TTR_PROBLEMS, train_to_targets, line

problem, opt, i, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
prune = int(sys.argv[5]) if len(sys.argv) > 5 else None
torch.set_num_threads(1)
spec = TTR_PROBLEMS[problem]
splits = make_splits(load_dataset(get_problem(problem).dataset), eval_size=spec.eval_size)
run = train_to_targets(GRIDS[problem][opt][i], problem, spec, splits, seed, prune)
print(line(problem, run), flush=True)
json.dump(asdict(run), open(f"logs/parts/{problem}_{opt}_{i}_{seed}.json", "w"))
