"""
Why schedule-free KFAC's idle-machine runs cost more per step than its interleaved cost says
(2026-12-03): the cost of a step along a run. Run from the repository root with
``CURVOPT_DATA`` set, ``PYTHONPATH=. OMP_NUM_THREADS=1``:

    python experiments/results/ttr/logs/sf_kfac_cost_along_run.py windows STEPS OPT ...
    python experiments/results/ttr/logs/sf_kfac_cost_along_run.py fixed_vs_fresh
    python experiments/results/ttr/logs/sf_kfac_cost_along_run.py old_vs_young OLD BLOCKS

``windows``: each 2C2D winner (``sf_kfac``, ``sf_adamw``, ...) trains STEPS steps from its
start on fresh batches (its base lr, no schedule: the cost does not depend on it); the mean
milliseconds of each 20-step window. ``fixed_vs_fresh``: schedule-free KFAC after 60 steps,
then 40-step windows alternating between fresh batches and the 10 fixed batches of the
interleaved cost (``experiments.ttr.cost.fixed_batches``): the mean, the median plain step and
the median curvature step of each window. ``old_vs_young``: two schedule-free KFAC
optimizers in one process, one trained OLD steps first, then 10-step blocks of each alternating
on the same fresh batches, BLOCKS each: the machine's drift is common to both, the difference
is the cost of the old one's later steps. Output: sf_kfac_cost_along_run.log.
"""

import statistics
import sys
import time

import torch

from experiments.data import load_dataset, make_splits, train_batches
from experiments.evaluation import Clock
from experiments.optimizers import make_optimizer
from experiments.problems import get_problem
from experiments.timing import timed_step
from experiments.ttr.cost import fixed_batches
from experiments.ttr.report import load_entries, winner_setting

torch.set_num_threads(1)
PROBLEM = "fmnist_2c2d"
WINNERS = {
    e["optimizer"]: winner_setting(e)
    for e in load_entries("experiments/results/ttr")
    if e["problem"] == PROBLEM
}
splits = make_splits(load_dataset("fmnist", "data"), eval_size=1)
problem = get_problem(PROBLEM)
prep = problem.preprocess(False)
clock = Clock(splits.train.x.device)


def trainer(name: str, seed: int):
    """A step function ``(x, y) -> seconds`` of the winner ``name``, built fresh."""
    torch.manual_seed(0)
    model, lossfunc = problem.model(0), problem.loss()
    opt, collects = make_optimizer(WINNERS[name].config(PROBLEM, 0), problem, model, lossfunc)

    def step(x, y) -> float:
        start = time.perf_counter()
        timed_step(model, lossfunc, opt, collects, x, y, clock)
        return time.perf_counter() - start

    return step, batches(torch.Generator().manual_seed(seed))


def batches(gen):
    """Fresh training batches of 128, epoch after epoch."""
    while True:
        yield from train_batches(splits.train, 128, prep, gen)


if sys.argv[1] == "windows":
    steps = int(sys.argv[2])
    for name in sys.argv[3:]:
        step, fresh = trainer(name, 0)
        times = [step(*next(fresh)) for _ in range(steps)]
        windows = [1e3 * statistics.mean(times[k : k + 20]) for k in range(0, steps, 20)]
        print(name, "ms per step, 20-step windows:", " ".join(f"{w:.0f}" for w in windows))
elif sys.argv[1] == "old_vs_young":
    old_steps, blocks = int(sys.argv[2]), int(sys.argv[3])
    old, fresh = trainer("sf_kfac", 0)
    young, _ = trainer("sf_kfac", 0)
    for _ in range(old_steps):
        old(*next(fresh))
    for k in range(blocks):
        block = [next(fresh) for _ in range(10)]
        t_old = sum(old(*b) for b in block) / 10
        t_young = sum(young(*b) for b in block) / 10
        print(
            f"block {k}: old (steps {old_steps + 10 * k}-{old_steps + 10 * k + 9}) "
            f"{1e3 * t_old:.0f} ms, young (steps {10 * k}-{10 * k + 9}) {1e3 * t_young:.0f} ms"
        )
else:
    step, fresh = trainer("sf_kfac", 1)
    fixed = fixed_batches(splits, 128, 10, prep)
    done = 60
    for _ in range(done):
        step(*next(fresh))
    for _ in range(4):
        for kind in ("fresh", "fixed"):
            times = [step(*(next(fresh) if kind == "fresh" else fixed[i % 10])) for i in range(40)]
            plain = [t for i, t in enumerate(times) if i % 10]
            curvature = [t for i, t in enumerate(times) if i % 10 == 0]
            print(
                f"steps {done}-{done + 39} {kind}: mean {1e3 * statistics.mean(times):.0f} ms, "
                f"plain median {1e3 * statistics.median(plain):.0f}, "
                f"curvature median {1e3 * statistics.median(curvature):.0f}"
            )
            done += 40
