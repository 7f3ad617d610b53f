"""Time to result: steps until a fixed test accuracy, with the same tuning budget for everyone.

Protocol (issue 19 item 4), the same for every optimizer:

1. The targets of each problem are fixed here (:data:`TTR_PROBLEMS`), before any tuning.
2. Evaluation is off the clock and at a fixed cadence in *steps* (every ``eval_every`` steps,
   and at step 0), on a fixed test subset, so that the steps to a target do not depend on the
   machine's load. A run stops at the first evaluation that reaches the highest target, or at
   the problem's step cap.
3. Tuning: every setting of the committed grid (:data:`GRIDS`, at least 4 per optimizer, fixed
   before tuning) trains with seed 0. The best is the one with the fewest steps to the highest
   target; ties go to fewer steps to the next lower target, and so on; then the first in the
   grid. Not reached counts as infinitely many steps. A tuning run that has taken as many
   steps as the best one so far needed for the highest target, without reaching it, cannot
   win and stops there (status ``pruned``): this saves time and changes no selection.
4. The winner runs seeds 1 and 2 (seed 0 is its tuning run).

All runs use the same data (the full training split minus the validation hold-out, reshuffled
every epoch, the problem's batch size) and the same thread count. The cost of a step is not
taken from these runs (the machine's load changes it) but measured interleaved in one process,
see :mod:`experiments.ttr.cost`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..config import RunConfig
from ..data import Splits, train_batches
from ..evaluation import Clock, split_sums
from ..optimizers import make_optimizer
from ..problems import get_problem
from ..timing import timed_step
from .schedules import SCHEDULES, lr_factor


@dataclass(frozen=True)
class TtrProblem:
    """Targets (test accuracy on the first ``eval_size`` test images, ascending) and budget:
    ``max_steps`` optimizer steps per run, an evaluation every ``eval_every`` steps."""

    targets: tuple[float, ...]
    max_steps: int
    eval_every: int = 25
    eval_size: int = 2000

    def __post_init__(self):
        if list(self.targets) != sorted(self.targets) or not self.targets:
            raise ValueError(f"targets must be non-empty and ascending, got {self.targets}")
        if self.max_steps < 1 or self.eval_every < 1:
            raise ValueError("max_steps and eval_every must be >= 1")


#: Fixed before tuning (issue 19 item 4). MNIST logreg is evaluated on the whole test set
#: (cheap), FMNIST 2C2D on its first 2,000 images.
TTR_PROBLEMS: dict[str, TtrProblem] = {
    "mnist_logreg": TtrProblem(targets=(0.92,), max_steps=1000, eval_every=25, eval_size=10_000),
    "fmnist_2c2d": TtrProblem(targets=(0.88, 0.90), max_steps=1500, eval_every=25, eval_size=2000),
}


@dataclass(frozen=True)
class Setting:
    """One point of a tuning grid: optimizer, lr, damping, preset, extra options, lr schedule."""

    optimizer: str
    lr: float
    damping: float | None = None
    preset: str | None = None
    options: tuple[tuple[str, Any], ...] = ()
    schedule: str = "constant"

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; choose from {SCHEDULES}")
        object.__setattr__(self, "options", tuple(sorted(dict(self.options).items())))

    def config(self, problem: str, seed: int, synthetic: bool = False) -> RunConfig:
        return RunConfig(
            problem,
            self.optimizer,
            self.lr,
            damping=self.damping,
            seed=seed,
            synthetic=synthetic,
            preset=self.preset,
            options=self.options,
        )

    def as_dict(self) -> dict:
        out = asdict(self)
        out["options"] = dict(self.options)
        return out

    @classmethod
    def from_dict(cls, d: dict) -> Setting:
        return cls(**{**d, "options": tuple(d.get("options", {}).items())})

    @property
    def label(self) -> str:
        parts = [f"lr {self.lr:g}"]
        if self.damping is not None:
            parts.append(f"damping {self.damping:g}")
        if self.preset:
            parts.append(self.preset)
        parts += [f"{k}={v}" for k, v in self.options]
        if self.schedule != "constant":
            parts.append(self.schedule)
        return f"{self.optimizer} " + ", ".join(parts)


def _grid(optimizer: str, *points: tuple) -> tuple[Setting, ...]:
    """``(lr, damping, preset, options dict, schedule)`` tuples (trailing fields optional)."""
    out = []
    for point in points:
        lr, damping, preset, options, schedule = (
            point + (None, None, {}, "constant")[len(point) - 1 :]
        )
        out.append(Setting(optimizer, lr, damping, preset, tuple(options.items()), schedule))
    return tuple(out)


WC = "warmup_cosine"
#: the README's KFAC settings (``kl_clip=1e-3``, kfac-pytorch's default trust region)
README_KL = {"kl_clip": 1e-3}
#: the paper's update (no trust region; the constructors' default is ``kl_clip=1e-3``)
PAPER_KL = {"kl_clip": None}

#: The tuning grids, fixed before tuning: problem -> optimizer -> settings, 4 each. The
#: baselines get two constant learning rates and two with linear warm-up and cosine decay
#: (AlgoPerf's baselines); KFAC (trace-norm damping) the paper's update, the README's setting
#: (kl_clip 1e-3) and the ``practical`` preset (curvature and inverses every 10 steps, EMA,
#: momentum, kl_clip); DiagGGN-Newton (MC curvature) and EKFAC alike.
GRIDS: dict[str, dict[str, tuple[Setting, ...]]] = {
    "mnist_logreg": {
        "momentum": _grid(
            "momentum", (0.03,), (0.1,), (0.1, None, None, {}, WC), (0.3, None, None, {}, WC)
        ),
        "adam": _grid(
            "adam", (1e-3,), (3e-3,), (3e-3, None, None, {}, WC), (1e-2, None, None, {}, WC)
        ),
        "kfac": _grid(
            "kfac",
            (0.1, 0.01, None, PAPER_KL),
            (0.3, 0.01, None, README_KL),
            (0.05, 1e-3, None, README_KL),
            (0.03, 0.01, "practical"),
        ),
        "diagggn_mc": _grid(
            "diagggn_mc",
            (0.01, 0.01, None, PAPER_KL),
            (0.1, 0.01, None, PAPER_KL),
            (0.3, 0.01, None, README_KL),
            (0.01, 0.01, "practical"),
        ),
        "ekfac": _grid(
            "ekfac",
            (0.1, 0.01, None, PAPER_KL),
            (0.3, 0.01, None, README_KL),
            (0.05, 1e-3, None, README_KL),
            (0.03, 0.01, "practical"),
        ),
    },
    "fmnist_2c2d": {
        "momentum": _grid(
            "momentum", (0.02,), (0.05,), (0.05, None, None, {}, WC), (0.1, None, None, {}, WC)
        ),
        "adam": _grid(
            "adam", (1e-3,), (2e-3,), (2e-3, None, None, {}, WC), (4e-3, None, None, {}, WC)
        ),
        "kfac": _grid(
            "kfac",
            (0.1, 0.1, None, PAPER_KL),
            (0.05, 1e-3, None, README_KL),
            (0.01, 0.1, "practical"),
            (0.01, 0.1, "practical", {"kl_clip": 1e-2}),
        ),
        "diagggn_mc": _grid(
            "diagggn_mc",
            (1e-3, 1e-3, None, PAPER_KL),
            (0.01, 0.01, None, PAPER_KL),
            (0.05, 1e-3, None, README_KL),
            (1e-3, 1e-3, "practical"),
        ),
        "ekfac": _grid(
            "ekfac",
            (0.1, 0.1, None, PAPER_KL),
            (0.05, 1e-3, None, README_KL),
            (0.01, 0.1, "practical"),
            (0.01, 0.1, "practical", {"kl_clip": 1e-2}),
        ),
    },
}

SEEDS = 3


@dataclass
class RunResult:
    """One run. ``steps_to``: target -> steps at the first evaluation reaching it (``None``:
    not reached); ``seconds_to``: the training seconds at that evaluation (this run's own
    clock, load dependent); ``curve``: ``[step, training seconds, test accuracy]`` per
    evaluation."""

    setting: dict
    seed: int
    steps_to: dict[str, int | None]
    seconds_to: dict[str, float | None]
    status: str
    steps: int = 0
    train_s: float = 0.0
    eval_s: float = 0.0
    per_step_s: dict[str, float] = field(default_factory=dict)
    curve: list[list[float]] = field(default_factory=list)


def target_key(target: float) -> str:
    return f"{target:g}"


def train_to_targets(
    setting: Setting,
    problem: str,
    spec: TtrProblem,
    splits: Splits,
    seed: int,
    prune_at: int | None = None,
) -> RunResult:
    """Train ``setting`` with ``seed`` until the highest target or ``spec.max_steps`` steps,
    evaluating the test subset at step 0 and every ``spec.eval_every`` steps (off the clock).

    ``prune_at``: stop (status ``pruned``) after that many steps without the highest target: a
    tuning run past the best run's steps to the highest target cannot win."""
    prob = get_problem(problem)
    device = splits.train.x.device
    cfg = setting.config(problem, seed, splits.synthetic)
    prep = prob.preprocess(cfg.augment)
    torch.manual_seed(seed)
    model = prob.model(seed, device)
    lossfunc = prob.loss()
    opt, collects = make_optimizer(cfg, prob, model, lossfunc)
    base_lrs = [g["lr"] for g in opt.param_groups]
    gen = torch.Generator().manual_seed(seed)
    clock = Clock(device)
    keys = [target_key(t) for t in spec.targets]
    run = RunResult(setting.as_dict(), seed, dict.fromkeys(keys), dict.fromkeys(keys), "capped")
    phases: dict[str, float] = {}

    def evaluate() -> bool:
        """Record the test accuracy; True when the highest target is reached."""
        t = clock()
        model.eval()
        _, correct = split_sums(model, lossfunc, splits.test, cfg.batch_size, prep)
        model.train()
        run.eval_s += clock() - t
        acc = correct / len(splits.test)
        run.curve.append([run.steps, round(run.train_s, 4), acc])
        for key, target in zip(keys, spec.targets):
            if run.steps_to[key] is None and acc >= target:
                run.steps_to[key], run.seconds_to[key] = run.steps, run.train_s
        return run.steps_to[keys[-1]] is not None

    done = evaluate()
    while not done and run.status == "capped":
        for x, y in train_batches(splits.train, cfg.batch_size, prep, gen):
            factor = lr_factor(setting.schedule, run.steps, spec.max_steps)
            for group, lr in zip(opt.param_groups, base_lrs):
                group["lr"] = lr * factor
            step = timed_step(model, lossfunc, opt, collects, x, y, clock)
            if step.diverged:
                run.status = "diverged"
                break
            run.steps += 1
            run.train_s += step.total_s
            for k, v in step.times.items():
                phases[k] = phases.get(k, 0.0) + v
            if run.steps % spec.eval_every == 0 or run.steps == spec.max_steps:
                done = evaluate()
            if done or run.steps >= min(spec.max_steps, prune_at or spec.max_steps):
                break
        if run.steps >= spec.max_steps:
            break
        if prune_at is not None and run.steps >= prune_at and not done:
            run.status = "pruned"
            break
    if done:
        run.status = "reached"
    run.per_step_s = {k: v / run.steps for k, v in phases.items()} if run.steps else {}
    return run


def selection_key(steps_to: dict[str, int | None], targets: tuple[float, ...]) -> tuple:
    """Sort key of a tuning run: steps to the highest target, then to the next lower, ...;
    not reached is infinite."""
    return tuple(
        math.inf if steps_to[target_key(t)] is None else steps_to[target_key(t)]
        for t in reversed(targets)
    )


def select(runs: list[RunResult], targets: tuple[float, ...]) -> int:
    """Index of the winning tuning run (the first of equal keys)."""
    return min(range(len(runs)), key=lambda i: (selection_key(runs[i].steps_to, targets), i))


def tune_and_run(
    problem: str,
    settings: tuple[Setting, ...],
    spec: TtrProblem,
    splits: Splits,
    seeds: int = SEEDS,
    log=print,
) -> dict:
    """The protocol for one optimizer on one problem: tuning runs (seed 0), the winner, and
    the winner's runs for seeds ``0..seeds-1`` (seed 0 being its tuning run)."""
    tuning = []
    for setting in settings:
        best = tuning[select(tuning, spec.targets)].steps_to if tuning else {}
        prune_at = best.get(target_key(spec.targets[-1]))
        tuning.append(train_to_targets(setting, problem, spec, splits, 0, prune_at))
        log(line(problem, tuning[-1]))
    best = select(tuning, spec.targets)
    winner = Setting.from_dict(tuning[best].setting)
    runs = [tuning[best]]
    for seed in range(1, seeds):
        runs.append(train_to_targets(winner, problem, spec, splits, seed))
        log(line(problem, runs[-1]))
    return {
        "problem": problem,
        "optimizer": settings[0].optimizer,
        "spec": asdict(spec),
        "tuning": [asdict(r) for r in tuning],
        "winner": best,
        "runs": [asdict(r) for r in runs],
    }


def line(problem: str, run: RunResult) -> str:
    reached = ", ".join(f"{k}: {'-' if v is None else v} steps" for k, v in run.steps_to.items())
    return (
        f"{problem} {Setting.from_dict(run.setting).label} seed {run.seed}: {run.status} "
        f"({reached}); {run.steps} steps in {run.train_s:.1f}s (+{run.eval_s:.1f}s eval)"
    )
