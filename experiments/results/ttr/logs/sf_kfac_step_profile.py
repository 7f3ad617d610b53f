"""Where a step of the 2C2D sf_kfac winner goes, beside schedule-free AdamW's (issue 29).

    PYTHONPATH=. OMP_NUM_THREADS=1 python experiments/results/ttr/logs/sf_kfac_step_profile.py

The winning settings of ``experiments/results/ttr`` (batch 128), trained on real FMNIST
batches: 20 warm-up steps, then 60 steps under cProfile (ms a step; cProfile inflates Python
time, so compare within a column). Per optimizer: the phases of ``timed_step`` and the
cumulative time of the optimizer's stages.
"""

import cProfile
import pstats
import time

import torch

from experiments.data import load_dataset, make_splits, train_batches
from experiments.optimizers import make_optimizer
from experiments.problems import get_problem
from experiments.timing import timed_step
from experiments.ttr.report import load_entries, winner_setting

STEPS, WARMUP = 60, 20
#: (label, file, function name) of the parts reported, cumulative ms a step
PARTS = (
    (
        "forward + backward (run_backward)",
        "~",
        "<method 'run_backward' of 'torch._C._EngineBase' objects>",
    ),
    ("optimizer step", "curvopt/optim/base.py", "_step"),
    ("  preconditioning", "curvopt/optim/stages/precondition.py", "__call__"),
    ("    factored step (fc1's)", "curvopt/optim/kfac.py", "_factored"),
    ("  schedule-free averaging", "curvopt/optim/stages/schedule_free.py", "__call__"),
    ("  trust region", "curvopt/optim/stages/trust_region.py", "__call__"),
    ("  curvature EMA", "curvopt/optim/stages/curvature_ema.py", "__call__"),
    ("  finite check", "curvopt/optim/plan.py", "check_finite"),
    ("schedule-free AdamW step", "schedulefree/adamw_schedulefree.py", "step"),
)


def profile(name, setting):
    problem = get_problem("fmnist_2c2d")
    model, lossfunc = problem.model(0), problem.loss()
    opt, collects = make_optimizer(setting.config("fmnist_2c2d", 0), problem, model, lossfunc)
    splits = make_splits(load_dataset("fmnist"), eval_size=1)
    batches = train_batches(
        splits.train, 128, problem.preprocess(False), torch.Generator().manual_seed(0)
    )
    for _ in range(WARMUP):
        timed_step(model, lossfunc, opt, collects, *next(batches), time.perf_counter)
    data = [next(batches) for _ in range(STEPS)]
    profiler = cProfile.Profile()
    start = time.process_time()
    profiler.enable()
    for x, y in data:
        timed_step(model, lossfunc, opt, collects, x, y, time.perf_counter)
    profiler.disable()
    total = 1e3 * (time.process_time() - start) / STEPS
    stats = pstats.Stats(profiler).stats
    print(f"\n{name}, {setting.label}: {total:.1f} ms a step under cProfile")
    for label, file, function in PARTS:
        ms = sum(v[3] for (f, _, fn), v in stats.items() if f.endswith(file) and fn == function)
        if ms:
            print(f"  {1e3 * ms / STEPS:7.1f} ms  {label}")


def main():
    torch.set_num_threads(1)
    winners = {
        e["optimizer"]: winner_setting(e)
        for e in load_entries("experiments/results/ttr")
        if e["problem"] == "fmnist_2c2d"
    }
    for name in ("sf_kfac", "sf_adamw"):
        profile(name, winners[name])


if __name__ == "__main__":
    main()
