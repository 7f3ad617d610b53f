"""Time to result: steps until a fixed test accuracy, with the same tuning budget for everyone.

Protocol, the same for every optimizer:

1. The targets of each problem are fixed here (:data:`TTR_PROBLEMS`), before any tuning. A new
   problem starts without targets; its reference optimizer (Adam, which is AdamW at weight
   decay 0) is tuned first by the highest accuracy it reaches within the cap
   (:func:`proposed_targets` gives the targets from it), the targets are written here, and only
   then are the others tuned (and Adam again, to the targets).
2. Evaluation is off the clock and at a fixed cadence in *steps* (every ``eval_every`` steps,
   and at step 0), on a fixed test subset, so that the steps to a target do not depend on the
   machine's load. A run stops at the first evaluation that reaches the highest target, or at
   the problem's step cap. ``max_steps`` and ``eval_every`` are given at the problem's batch
   size and mean the same amount of *data* at every batch size (:meth:`TtrProblem.at_batch`).
3. Tuning: every setting of the committed grid (:mod:`.grids`, 4 per optimizer at each batch
   size) trains with seed 0. At each batch size the best is the one with the fewest steps to
   the highest target; ties go to fewer steps to the next lower target, and so on. Not reached
   counts as infinitely many steps. A tuning run that has taken as many steps as the best one
   of its batch size so far needed for the highest target, without reaching it, cannot win and
   stops there (status ``pruned``). The best of each batch size, and every run tied with it
   (the same steps to every target), are the candidates; where more than one reached the
   highest target they are compared in time: steps × their cost per step, measured
   interleaved (:func:`experiments.ttr.cost.measure_costs`) right after the tuning; then the
   first in the grid.
4. The winner runs seeds 1 and 2 (seed 0 is its tuning run).

Runs are deterministic per seed, so a resumed protocol (:func:`reusable_runs`) takes the runs of
an earlier entry of the same problem and spec instead of training them again: a run of the same
setting and seed, unless it was pruned later than this tuning would prune it.

All runs use the same data (the full training split minus the validation hold-out, reshuffled
every epoch) and the same thread count.

The metric is the problem's: test accuracy (higher is better) for the classifiers; a workload of
:mod:`experiments.workloads` names its own (``fortunes_gpt``: bits per character on the held-out
text, ``mnist_autoencoder``: squared reconstruction error per test image), lower is better. A
target is reached at the first evaluation at or beyond it in the metric's direction; targets are
listed easiest first (ascending for accuracy, descending for a loss). Schedule-free AdamW is
evaluated at its averaged weights (:func:`experiments.peers.averaged_weights`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

import torch

from ..data import Splits, train_batches
from ..evaluation import Clock, split_sums
from ..optimizers import make_optimizer
from ..peers import averaged_weights, compile_info
from ..problems import get_problem
from ..timing import timed_step
from .cost import measure_costs
from .grids import GRIDS, Setting
from .schedules import lr_factor

__all__ = ["GRIDS", "Setting", "TtrProblem", "TTR_PROBLEMS", "tune_and_run", "train_to_targets"]


@dataclass(frozen=True)
class TtrProblem:
    """Targets (the problem's metric on the first ``eval_size`` test samples, easiest first:
    ascending, or descending with ``lower_is_better``; empty: not yet fixed) and budget:
    ``max_steps`` optimizer steps per run, an evaluation every ``eval_every`` steps, both at the
    problem's own batch size."""

    targets: tuple[float, ...]
    max_steps: int
    eval_every: int = 25
    eval_size: int = 2000
    lower_is_better: bool = False

    def __post_init__(self):
        if list(self.targets) != sorted(self.targets, reverse=self.lower_is_better):
            order = "descending" if self.lower_is_better else "ascending"
            raise ValueError(f"targets must be {order}, got {self.targets}")
        if self.max_steps < 1 or self.eval_every < 1:
            raise ValueError("max_steps and eval_every must be >= 1")

    def at_batch(self, batch_size: int, base_batch_size: int) -> TtrProblem:
        """The same budget in data at ``batch_size``: steps and cadence × base / batch."""
        scale = base_batch_size / batch_size
        return replace(
            self,
            max_steps=max(1, round(self.max_steps * scale)),
            eval_every=max(1, round(self.eval_every * scale)),
        )


#: Fixed before tuning. MNIST logreg is evaluated on the whole test set (cheap), the FMNIST
#: problems on their first 2,000 images. The ViT's targets were fixed from Adam's tuning
#: (protocol step 1: lr 0.002, warm-up + cosine, batch 128 reached 0.872 within the cap;
#: ``fmnist_vit_adam_calibration.json``).
TTR_PROBLEMS: dict[str, TtrProblem] = {
    "mnist_logreg": TtrProblem(targets=(0.92,), max_steps=1000, eval_every=25, eval_size=10_000),
    "fmnist_2c2d": TtrProblem(targets=(0.88, 0.90), max_steps=1500, eval_every=25, eval_size=2000),
    "fmnist_vit": TtrProblem(targets=(0.84, 0.86), max_steps=1500, eval_every=25, eval_size=2000),
    # bits per character on the first 512 validation windows (32,768 characters), batch 32. The
    # targets are Adam's calibration's proposed_targets at a cap of 1,000 steps (--max-steps
    # 1000; fortunes_gpt_adam_calibration.json, logs/calibration_gpt_adam.log): its grid's best,
    # lr 0.004 with warm-up + cosine, reached 2.797 (2.83 at step 800, 2.98 at 550); the
    # benchmark's cap is twice that.
    "fortunes_gpt": TtrProblem(
        targets=(2.98, 2.83), max_steps=2000, eval_every=25, eval_size=512, lower_is_better=True
    ),
    # squared reconstruction error per image on the first 2,000 test images, batch 128; targets
    # as the GPT's (mnist_autoencoder_adam_calibration.json): Adam's best, lr 0.001 constant,
    # reached 10.58 (10.7 at step 975, 11.3 at 875).
    "mnist_autoencoder": TtrProblem(
        targets=(11.3, 10.7), max_steps=2000, eval_every=25, eval_size=2000, lower_is_better=True
    ),
}
#: the optimizer whose tuning fixes a new problem's targets
CALIBRATION_OPTIMIZER = "adam"

SEEDS = 3


@dataclass
class RunResult:
    """One run. ``steps_to``: target -> steps at the first evaluation reaching it (``None``:
    not reached); ``seconds_to``: the training seconds at that evaluation (this run's own
    clock, load dependent, including a compiling peer's ``compile`` seconds); ``curve``:
    ``[step, training seconds, test accuracy]`` per evaluation; ``max_steps`` the cap at this
    run's ``batch_size``; ``compile``: :func:`experiments.peers.compile_info`."""

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
    batch_size: int | None = None
    max_steps: int | None = None
    compile: dict | None = None


def target_key(target: float) -> str:
    return f"{target:g}"


def reached(value: float, target: float, lower_is_better: bool = False) -> bool:
    """``value`` is at or beyond ``target`` in the metric's direction."""
    return value <= target if lower_is_better else value >= target


def metric_value(prob, model, lossfunc, split, batch_size: int, prep) -> float:
    """The problem's metric on ``split``: test accuracy, or a workload's own ``score``."""
    score = getattr(prob, "score", None)
    if score is not None:
        return score(model, lossfunc, split, batch_size, prep)
    _, correct = split_sums(model, lossfunc, split, batch_size, prep)
    return correct / len(split)


def train_to_targets(
    setting: Setting,
    problem: str,
    spec: TtrProblem,
    splits: Splits,
    seed: int,
    prune_at: int | None = None,
) -> RunResult:
    """Train ``setting`` with ``seed`` until the highest target or the step cap (``spec`` at
    the setting's batch size), evaluating the test subset at step 0 and every ``eval_every``
    steps (off the clock).

    ``prune_at``: stop (status ``pruned``) after that many steps without the highest target: a
    tuning run past the best run's steps to the highest target cannot win."""
    prob = get_problem(problem)
    device = splits.train.x.device
    cfg = setting.config(problem, seed, splits.synthetic)
    spec = spec.at_batch(cfg.batch_size, prob.batch_size)
    if len(splits.train) < cfg.batch_size:
        raise ValueError(
            f"{problem}: batch size {cfg.batch_size} is larger than the training split "
            f"({len(splits.train)} samples); use a smaller batch size"
        )
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
    run.batch_size, run.max_steps, run.compile = cfg.batch_size, spec.max_steps, compile_info(opt)
    run.train_s = run.compile["compile_s"] if run.compile else 0.0
    phases: dict[str, float] = {}

    def evaluate() -> bool:
        """Record the test metric; True when the highest target is reached."""
        t = clock()
        model.eval()
        with averaged_weights(opt):
            acc = metric_value(prob, model, lossfunc, splits.test, cfg.batch_size, prep)
        model.train()
        run.eval_s += clock() - t
        if not math.isfinite(acc):
            acc = math.inf if spec.lower_is_better else 0.0
        run.curve.append([run.steps, round(run.train_s, 4), acc])
        for key, target in zip(keys, spec.targets):
            if run.steps_to[key] is None and reached(acc, target, spec.lower_is_better):
                run.steps_to[key], run.seconds_to[key] = run.steps, run.train_s
        return bool(keys) and run.steps_to[keys[-1]] is not None

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


def best_accuracy(run: RunResult, lower_is_better: bool = False) -> float:
    """The best metric value of the run's evaluations (the lowest with ``lower_is_better``)."""
    values = [acc for _, _, acc in run.curve]
    return min(values) if lower_is_better else max(values)


def _key(
    run: RunResult, targets: tuple[float, ...], cost: float = 1.0, lower_is_better=False
) -> tuple:
    """Steps (× ``cost``) to the targets; without targets the best metric value reached."""
    if not targets:
        best = best_accuracy(run, lower_is_better)
        return (best if lower_is_better else -best,)
    return tuple(s * cost for s in selection_key(run.steps_to, targets))


def select(runs: list[RunResult], targets: tuple[float, ...], lower_is_better=False) -> int:
    """Index of the winning tuning run (the first of equal keys)."""
    return min(range(len(runs)), key=lambda i: (_key(runs[i], targets, 1.0, lower_is_better), i))


def proposed_targets(run: RunResult, lower_is_better: bool = False) -> tuple[float, float]:
    """A new problem's targets from its calibration winner's seed-0 run, easiest first.

    Accuracy: the highest accuracy it reached less 0.01, rounded down to a multiple of 0.01,
    and 0.02 below that. A loss (``lower_is_better``): the lowest value times 1.01, rounded up
    to 3 significant digits, and that times 1.05 (rounded up alike): a target the calibration
    reached with a margin of 1 %, and one 5 % easier."""
    if not lower_is_better:
        top = math.floor(round((best_accuracy(run) - 0.01) * 100, 6)) / 100
        return (round(top - 0.02, 2), top)
    top = _round_up(best_accuracy(run, True) * 1.01)
    return (_round_up(top * 1.05), top)


def _round_up(x: float, digits: int = 3) -> float:
    """``x`` rounded up to ``digits`` significant digits."""
    scale = 10 ** (digits - 1 - math.floor(math.log10(abs(x))))
    return math.ceil(round(x * scale, 6)) / scale


def spec_dict(spec: TtrProblem) -> dict:
    """``spec`` as written into an entry: ``lower_is_better`` only where it is true, so that
    the entries written before it existed keep their spec."""
    out = {**asdict(spec), "targets": list(spec.targets)}
    if not spec.lower_is_better:
        del out["lower_is_better"]
    return out


def reusable_runs(entry: dict | None, problem: str, spec: TtrProblem) -> dict[tuple, RunResult]:
    """An earlier entry's runs (tuning and seeds) by ``(setting, seed)``, if it has the same
    ``spec``; a setting written without a batch size is at the problem's."""
    if not entry or entry.get("spec") != spec_dict(spec):
        return {}
    out = {}
    for d in entry["tuning"] + entry["runs"]:
        run = RunResult(**d)
        setting = Setting.from_dict(run.setting)
        if setting.batch_size is None:
            setting = replace(setting, batch_size=get_problem(problem).batch_size)
            run.setting, run.batch_size = setting.as_dict(), setting.batch_size
        out[setting, run.seed] = run
    return out


def tune_and_run(
    problem: str,
    settings: tuple[Setting, ...],
    spec: TtrProblem,
    splits: Splits,
    seeds: int = SEEDS,
    log=print,
    cost_rounds: int = 3,
    done: dict[tuple, RunResult] | None = None,
) -> dict:
    """The protocol for one optimizer on one problem: tuning runs (seed 0), at each batch size
    its winner, the winner across batch sizes (in time, ``cost_rounds`` interleaved rounds),
    and the winner's runs for seeds ``0..seeds-1`` (seed 0 being its tuning run). ``done``:
    :func:`reusable_runs`, taken instead of training where they are what training would give."""
    done = done or {}
    reused = []

    def run(setting: Setting, seed: int, prune_at: int | None = None) -> RunResult:
        old = done.get((setting, seed))
        if old is not None and (old.status != "pruned" or (prune_at or math.inf) <= old.steps):
            reused.append(old)
            log(line(problem, old) + " (reused)")
            return old
        new = train_to_targets(setting, problem, spec, splits, seed, prune_at)
        log(line(problem, new))
        return new

    def key(r: RunResult, cost: float = 1.0) -> tuple:
        return _key(r, spec.targets, cost, spec.lower_is_better)

    tuning: list[RunResult] = []
    best_of: dict[int | None, int] = {}  # batch size -> index of its best tuning run
    for setting in settings:
        own = best_of.get(setting.batch_size)
        prune_at = None
        if own is not None and spec.targets:
            prune_at = tuning[own].steps_to[target_key(spec.targets[-1])]
        tuning.append(run(setting, 0, prune_at))
        if own is None or key(tuning[-1]) < key(tuning[own]):
            best_of[setting.batch_size] = len(tuning) - 1
    candidates = [
        i
        for i, (setting, r) in enumerate(zip(settings, tuning))
        if key(r) == key(tuning[best_of[setting.batch_size]])
    ]
    costs = _candidate_costs(problem, tuning, candidates, spec, splits, cost_rounds, log)

    def in_time(i: int) -> tuple:
        """Steps × the candidate's cost (a candidate whose cost failed cannot win)."""
        cost = costs.get(str(i), math.inf) if costs else 1.0
        return (key(tuning[i], cost) if cost < math.inf else (math.inf,), i)

    best = min(candidates, key=in_time)
    winner = Setting.from_dict(tuning[best].setting)
    runs = [tuning[best]]
    for seed in range(1, seeds):
        runs.append(run(winner, seed))
    entry = {
        "problem": problem,
        "optimizer": settings[0].optimizer,
        "spec": spec_dict(spec),
        "tuning": [asdict(r) for r in tuning],
        "batch_winners": {str(tuning[i].batch_size): i for i in best_of.values()},
        "candidate_costs": costs,
        "winner": best,
        "runs": [asdict(r) for r in runs],
        "reused_runs": len(reused),
    }
    if not spec.targets:
        entry["proposed_targets"] = list(proposed_targets(runs[0], spec.lower_is_better))
    return entry


def _candidate_costs(problem, tuning, candidates, spec, splits, rounds, log) -> dict[str, float]:
    """Cost per step (CPU seconds) of each candidate (by its index in ``tuning``), measured
    interleaved, when more than one reached the highest target (else nothing to compare)."""
    reached = [i for i in candidates if tuning[i].status == "reached"]
    if len(reached) < 2 or not spec.targets:
        return {}
    settings = {str(i): Setting.from_dict(tuning[i].setting) for i in reached}
    measured = measure_costs(problem, settings, splits, rounds=rounds, warmup=1, log=log)
    return {
        name: e["per_step_s"]
        for name, e in measured["entries"].items()
        if e["per_step_s"] is not None
    }


def line(problem: str, run: RunResult) -> str:
    done = ", ".join(f"{k}: {'-' if v is None else v} steps" for k, v in run.steps_to.items())
    if not run.steps_to and run.curve:
        prob = get_problem(problem)
        lower = getattr(prob, "lower_is_better", False)
        done = f"best {getattr(prob, 'metric', 'accuracy')} {best_accuracy(run, lower):.4f}"
    return (
        f"{problem} {Setting.from_dict(run.setting).label} seed {run.seed}: {run.status} "
        f"({done}); {run.steps} steps in {run.train_s:.1f}s (+{run.eval_s:.1f}s eval)"
    )
