"""Where an optimizer step's time goes: forward, backward and step, curvature steps apart.

    OMP_NUM_THREADS=1 python -m experiments step_profile fmnist_2c2d kfac:practical:0.01:0.1

Each ``OPTIMIZER[:PRESET[:LR[:DAMPING]]]`` trains ``--steps`` steps on one fixed random batch of
the problem's batch size (the first step, a warm-up, is not counted) and reports the median
milliseconds of the three phases, separately for curvature steps (every ``curvature_interval``
steps: their backward pass computes the curvature, their step inverts it) and plain steps.
The extra cost of the curvature is ``backward(curvature) - backward(plain)``, that of the
inversion ``step(curvature) - step(plain)``; ``step(plain)`` is the preconditioned update.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from .commands import Command, add_threads, set_threads
from .config import RunConfig
from .data import SPECS
from .optimizers import DAMPED, make_optimizer, resolve_options
from .problems import PROBLEMS, get_problem
from .timing import timed_step


def profile(cfg: RunConfig, steps: int = 21) -> dict[str, dict[str, float]]:
    """``{"curvature"|"plain": {"n", "forward_ms", "backward_ms", "step_ms"}}`` (medians)."""
    problem = get_problem(cfg.problem)
    gen = torch.Generator().manual_seed(cfg.seed)
    x = torch.randn(cfg.batch_size, *problem.input_shape, generator=gen)
    y = torch.randint(0, SPECS[problem.dataset].num_classes, (cfg.batch_size,), generator=gen)
    model, lossfunc = problem.model(cfg.seed), problem.loss()
    opt, collects = make_optimizer(cfg, problem, model, lossfunc)
    interval = resolve_options(cfg.optimizer, cfg.preset, cfg.options).get("curvature_interval", 1)
    records: dict[str, list[tuple[float, float, float]]] = {"curvature": [], "plain": []}
    for i in range(steps):
        step = timed_step(model, lossfunc, opt, collects, x, y, time.perf_counter)
        if step.diverged:
            raise FloatingPointError(f"{cfg.name} diverged at step {i} of the profile")
        if i:
            kind = "curvature" if collects and i % interval == 0 else "plain"
            t = step.times
            records[kind].append((t["forward_s"] + t["check_s"], t["backward_s"], t["step_s"]))
    return {
        kind: {
            "n": len(r),
            **{
                f"{name}_ms": 1e3 * statistics.median(t[k] for t in r)
                for k, name in enumerate(("forward", "backward", "step"))
            },
        }
        for kind, r in records.items()
        if r
    }


def _config(problem: str, spec: str) -> RunConfig:
    """``kfac:practical:0.01:0.1`` -> its RunConfig (lr 1e-3 and damping 1e-3 by default)."""
    name, preset, lr, damping = (spec.split(":") + ["", "", "", ""])[:4]
    return RunConfig(
        problem,
        name,
        float(lr or 1e-3),
        damping=float(damping or 1e-3) if name in DAMPED else None,
        preset=preset or None,
    )


DESCRIPTION = """\
Where an optimizer step's time goes. Each OPTIMIZER[:PRESET[:LR[:DAMPING]]] (lr and damping
1e-3 when left out) trains --steps steps on one fixed random batch of the problem's batch size
(the first step, a warm-up, is not counted) and prints the median milliseconds of forward,
backward and step, separately for curvature steps (every curvature_interval steps: their
backward pass computes the curvature, their step inverts it) and plain steps.

example: OMP_NUM_THREADS=1 python -m experiments step_profile fmnist_2c2d adam \\
           kfac:paper:0.1:0.1 kfac:practical:0.01:0.1
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("problem", choices=list(PROBLEMS), help="the DeepOBS problem")
    p.add_argument(
        "optimizers", nargs="+", metavar="OPTIMIZER[:PRESET[:LR[:DAMPING]]]", help="what to time"
    )
    p.add_argument("--steps", type=int, default=21, help="steps per optimizer, warm-up included")
    add_threads(p, default=1)


def execute(args: argparse.Namespace) -> int:
    set_threads(args.threads)
    for spec in args.optimizers:
        for kind, r in profile(_config(args.problem, spec), args.steps).items():
            print(
                f"{spec} {kind} steps (n={r['n']}): forward {r['forward_ms']:.0f} ms, "
                f"backward {r['backward_ms']:.0f} ms, step {r['step_ms']:.0f} ms",
                flush=True,
            )
    return 0


STEP_PROFILE = Command(
    "step_profile",
    "milliseconds of forward, backward and step of optimizers on one batch",
    DESCRIPTION,
    add_arguments,
    execute,
    aliases=("step-profile",),
)


def main(argv=None) -> int:
    return STEP_PROFILE.main(argv)


if __name__ == "__main__":
    sys.exit(main())
