"""Cost per step of every optimizer of issue 53's workloads (``fortunes_gpt``,
``mnist_autoencoder``), before any tuning: one representative setting of each grid (the
cost of a step does not depend on the lr; for KFAC the ``practical`` preset, curvature and
inverses every 10 steps, with the whole batch's and with 16 samples' curvature; schedule-free
KFAC's first setting), measured interleaved by ``experiments.ttr.cost.measure_costs`` (blocks of
10 steps on fixed batches, round-robin, CPU time at one thread; median of the counted rounds).

heavyball's peers run eager here (``COMPILE_MODES = ()``): a compilation takes minutes on this
CPU (KLSOAP's and PSGD-Kron's fail in every mode), more than this measurement could spend; the
benchmark's own runs try to compile SOAP and MuonAdamW.

Run from the repository root (writes ``workload_costs.json`` beside the results):

    PYTHONPATH=. OMP_NUM_THREADS=1 nice python experiments/results/ttr/logs/workload_costs.py \\
        PROBLEM [ROUNDS]
"""

import json
import sys
from pathlib import Path

import torch

from experiments import peers
from experiments.problems import get_problem
from experiments.ttr.cli import _machine
from experiments.ttr.cost import measure_costs
from experiments.ttr.grids import GRIDS
from experiments.ttr.report import write_json

#: optimizer name in the output -> (grid optimizer, index in its grid)
PICKS = {
    "adam": ("adam", 0),
    "sf_adamw": ("sf_adamw", 0),
    "soap": ("soap", 0),
    "psgd_kron": ("psgd_kron", 0),
    "muon": ("muon", 0),
    "muon_adamw": ("muon_adamw", 0),
    "klsoap": ("klsoap", 0),
    "kfac_practical": ("kfac", 2),
    "kfac_practical_sub16": ("kfac", 3),
    "sf_kfac": ("sf_kfac", 0),
}
OUT = Path("experiments/results/ttr/workload_costs.json")


def main(problem: str, rounds: int = 3) -> None:
    torch.set_num_threads(1)
    peers.COMPILE_MODES = ()
    settings = {name: GRIDS[problem][opt][i] for name, (opt, i) in PICKS.items()}
    splits = get_problem(problem).splits(None, False, 16, "cpu")
    out = measure_costs(problem, settings, splits, rounds=rounds, warmup=1, log=print)
    out["meta"] = {
        "command": "PYTHONPATH=. OMP_NUM_THREADS=1 nice python "
        f"experiments/results/ttr/logs/workload_costs.py {problem} {rounds}",
        "machine": _machine(),
        "threads": 1,
        "torch": torch.__version__,
        "heavyball": "eager (COMPILE_MODES = ())",
    }
    old = json.loads(OUT.read_text()) if OUT.is_file() else {}
    old[problem] = out
    write_json(OUT, old)
    print(f"{problem}: ms per step (CPU, median of {rounds} rounds; wall)")
    ref = out["entries"]["adam"]["per_step_s"]
    for name, e in out["entries"].items():
        cpu, wall = e["per_step_s"], e["per_step_wall_s"]
        if cpu is None:
            print(f"  {name:22s} failed: {e['failed']}")
        else:
            print(f"  {name:22s} {1e3 * cpu:7.1f} ({1e3 * wall:7.1f})  x Adam {cpu / ref:5.2f}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3)
