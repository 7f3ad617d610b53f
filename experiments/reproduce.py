"""The main job: the BackPACK paper's experiments (Dangel et al., ICLR 2020), budgeted by default.

    python -m experiments.reproduce               # budgeted: a few minutes on 2 CPU cores
    python -m experiments.reproduce --dry-run     # print the plan and the full-protocol commands
    python -m experiments.reproduce --full        # the paper's protocol (days; use a GPU)

Default (budgeted, real data): MNIST logistic regression (2 epochs) and Fashion-MNIST 2C2D (3
epochs on 1024 training images), momentum / Adam / DiagGGN-MC / KFAC with fixed
hyper-parameters (``BUDGET_HPARAMS``), 3 seeds; the overhead table of 3C3D (few rounds); then
the figures (``paper_figs``) and the table of final test accuracies next to the paper's, every
budgeted number marked as not comparable. Missing MNIST / Fashion-MNIST are fetched first
(``experiments.fetch_data``); a data set that cannot be had is reported and skipped.

``--full``: all four problems, the optimizers the paper ran on each, the paper's grid
(lr in {1e-4, 1e-3, 1e-2, 1e-1, 1} x damping in {1e-4, 1e-3, 1e-2, 1e-1, 1, 10}, damping only
for the curvature methods), the best setting by final validation accuracy rerun with 10 seeds,
the problems' full epochs and training sets, the full overhead table.

Everything goes below ``--out``: ``runs/`` (one JSON per run, resumable: a finished run is
skipped when the job is started again), ``overhead.json``, ``figures/*.png``,
``comparison.md`` and ``summary.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from .data import DataMissingError, ImageData, default_root, load_dataset, make_splits
from .problems import PROBLEMS, get_problem
from .runner import (
    DAMPED,
    OPTIMIZERS,
    PAPER_DAMPINGS,
    PAPER_LRS,
    RunConfig,
    SetupError,
    grid,
    resolve_device,
    run,
)

# --- the plan ---------------------------------------------------------------------------------

#: The optimizers the paper reports on each problem (its table of final test accuracies).
PAPER_OPTIMIZERS: dict[str, tuple[str, ...]] = {
    "mnist_logreg": ("momentum", "adam", "diagggn", "diagggn_mc", "kfac", "kflr"),
    "fmnist_2c2d": ("momentum", "adam", "diagggn", "diagggn_mc", "kfac", "kflr"),
    "cifar10_3c3d": ("momentum", "adam", "diagggn", "diagggn_mc", "kfac", "kflr"),
    "cifar100_allcnnc": ("momentum", "adam", "diagggn_mc", "kfac"),
}
PAPER_SEEDS = 10

BUDGET_PROBLEMS = ("mnist_logreg", "fmnist_2c2d")
BUDGET_OPTIMIZERS = ("momentum", "adam", "diagggn_mc", "kfac")


@dataclass(frozen=True)
class Budget:
    """How much of a problem the job trains on: epochs, samples, evaluation size, seeds."""

    epochs: int
    train_size: int | None
    eval_size: int | None
    seeds: int = 1


#: Budgeted runs, sized for 5-7 minutes on 2 shared CPU cores, 3 seeds each. MNIST logreg is
#: cheap: the whole training set, 2 epochs. On 2C2D a KFAC step costs ~2.5 s on one core (it
#: inverts a 3137 x 3137 Kronecker factor every step, as in the paper) against ~0.15 s for
#: momentum, and evaluating 1000 images ~1 s, so it gets 3 epochs of 8 steps and capped
#: evaluation sets: enough to run the whole pipeline on real data, far too little to compare
#: accuracies.
BUDGETS: dict[str, Budget] = {
    "mnist_logreg": Budget(epochs=2, train_size=None, eval_size=None, seeds=3),
    "fmnist_2c2d": Budget(epochs=3, train_size=1024, eval_size=500, seeds=3),
    "cifar10_3c3d": Budget(epochs=2, train_size=1280, eval_size=1000, seeds=1),
    "cifar100_allcnnc": Budget(epochs=2, train_size=1280, eval_size=1000, seeds=1),
}

#: (lr, damping) of the budgeted runs. Not the paper's selected values (it reports only the
#: accuracies): picked once, by final validation accuracy of seed 0, from a small grid.
#: MNIST (on 10,240 samples x 3 epochs): lr in {0.01, 0.1, 1} x damping in {1e-3, 1e-2, 1e-1}.
#: 2C2D (on the budget above): momentum lr in {0.01, 0.1}, Adam lr in {1e-4, 1e-3}, DiagGGN-MC
#: (lr, damping) in {(1e-3, 1e-3), (1e-2, 1e-2), (0.1, 0.1)}, KFAC in {(1e-2, 1e-2), (0.1, 0.1)}.
#: DiagGGN / KFLR / KFRA / M-SVAG and the CIFAR problems are untuned guesses (copied from the
#: Monte-Carlo sibling or momentum). ``--lr-grid`` searches the paper's grid on the budget.
BUDGET_HPARAMS: dict[str, dict[str, tuple[float, float | None]]] = {
    "mnist_logreg": {
        "momentum": (0.1, None),
        "adam": (0.01, None),
        "diagggn": (0.01, 0.01),
        "diagggn_mc": (0.01, 0.01),
        "kfac": (0.1, 0.01),
        "kflr": (0.1, 0.01),
        "kfra": (0.1, 0.01),
        "vsgd": (0.1, None),
    },
    "fmnist_2c2d": {
        "momentum": (0.01, None),
        "adam": (1e-3, None),
        "diagggn": (1e-3, 1e-3),
        "diagggn_mc": (1e-3, 1e-3),
        "kfac": (0.1, 0.1),
        "kflr": (0.1, 0.1),
        "kfra": (0.1, 0.1),
        "vsgd": (0.01, None),
    },
    "cifar10_3c3d": {
        "momentum": (0.01, None),
        "adam": (1e-3, None),
        **{o: (0.01, 0.01) for o in ("diagggn", "diagggn_mc", "kfac", "kflr", "kfra")},
        "vsgd": (0.01, None),
    },
    "cifar100_allcnnc": {
        "momentum": (0.01, None),
        "adam": (1e-3, None),
        **{o: (0.01, 0.01) for o in ("diagggn", "diagggn_mc", "kfac", "kflr", "kfra")},
        "vsgd": (0.01, None),
    },
}

#: Overhead table: the network and quantities (first order from experiments.overhead, second
#: order registered here). Budgeted: Monte-Carlo curvature only (one backpropagated column).
OVERHEAD_PROBLEMS = ("3c3d",)
BUDGET_SECOND_ORDER = ("DiagGGNMC", "KFAC")
FULL_SECOND_ORDER = ("DiagGGNMC", "DiagGGNExact", "KFAC", "KFLR", "KFRA", "DiagHessian")
FIRST_ORDER = ("hooks", "BatchGrad", "BatchL2Grad", "SumGradSquared", "Variance")


@dataclass
class Plan:
    problems: list[str]
    optimizers: dict[str, list[str]]
    seeds: dict[str, int]
    full: bool
    budgets: dict[str, Budget] = field(default_factory=dict)
    hparams: dict[str, dict[str, tuple[float, float | None]]] = field(default_factory=dict)
    lr_grid: bool = False

    def configs(self, problem: str, synthetic: bool) -> list[RunConfig]:
        """The budgeted runs of ``problem`` (``--full`` uses :func:`runner.grid` instead)."""
        b = self.budgets[problem]
        out = []
        for opt in self.optimizers[problem]:
            lr, damping = self.hparams[problem][opt]
            damping = damping if opt in DAMPED else None
            for seed in range(self.seeds[problem]):
                out.append(
                    RunConfig(
                        problem,
                        opt,
                        lr,
                        damping=damping,
                        seed=seed,
                        epochs=b.epochs,
                        train_size=b.train_size,
                        eval_size=b.eval_size,
                        synthetic=synthetic,
                    )
                )
        return out


# --- command line -----------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m experiments.reproduce",
        description=__doc__.split("\n\n")[0],
        epilog="Without --full every number is budgeted and marked as not comparable.",
    )
    p.add_argument("--full", action="store_true", help="the paper's whole protocol (see above)")
    p.add_argument(
        "--out",
        type=Path,
        help="output folder (default results/reproduce, results/reproduce_full with --full)",
    )
    p.add_argument(
        "--problems",
        nargs="+",
        choices=list(PROBLEMS),
        help=f"default: {' '.join(BUDGET_PROBLEMS)} (--full: all four)",
    )
    p.add_argument(
        "--optimizers",
        nargs="+",
        choices=list(OPTIMIZERS),
        help=f"default: {' '.join(BUDGET_OPTIMIZERS)} (--full: the paper's per problem)",
    )
    p.add_argument(
        "--seeds",
        type=int,
        help=f"seeds per setting (default 3, CIFAR 1; --full: {PAPER_SEEDS})",
    )
    p.add_argument("--epochs", type=int, help="override the epochs of every problem")
    p.add_argument(
        "--train-size",
        type=int,
        help="override the training subset of every problem (0: the whole training set)",
    )
    p.add_argument("--eval-size", type=int, help="override the evaluation cap (0: no cap)")
    p.add_argument(
        "--lr-grid",
        action="store_true",
        help="budgeted: search the paper's grid on the budget instead of the fixed "
        "hyper-parameters (30 runs per curvature method; slow)",
    )
    p.add_argument(
        "--synthetic",
        action="store_true",
        help="random data of the right shapes instead of the real data sets (for "
        "checking the pipeline; marked SYNTHETIC everywhere)",
    )
    p.add_argument(
        "--data-root",
        type=Path,
        default=None,
        help=f"data folder (default $CURVOPT_DATA or ./data; now {default_root()})",
    )
    p.add_argument(
        "--no-fetch",
        dest="fetch",
        action="store_false",
        help="do not run experiments.fetch_data when a data set is missing",
    )
    p.add_argument(
        "--no-overhead", dest="overhead", action="store_false", help="skip the overhead table"
    )
    p.add_argument("--overhead-rounds", type=int, help="interleaved rounds (default 7; --full 25)")
    p.add_argument(
        "--overhead-seconds",
        type=float,
        help="time limit of the overhead rounds per network (default 30; --full 120)",
    )
    p.add_argument("--device", default="auto", help="auto (default), cpu, cuda, ...")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads for training and the overhead table (default: "
        "min(2, CPUs) on an idle machine, 1 when the load average is above half the "
        "CPUs: on a busy machine OpenMP threads wait for each other, e.g. a KFAC "
        "step of MNIST logreg took 3-8 s with 2 threads and 0.05 s with 1)",
    )
    p.add_argument(
        "--fresh",
        action="store_true",
        help="delete this output folder's earlier runs first (default: reuse them)",
    )
    p.add_argument("--progress", action="store_true", help="progress bars per epoch")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the commands only")
    args = p.parse_args(argv)
    for name in ("seeds", "epochs", "overhead_rounds", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("train_size", "eval_size"):
        value = getattr(args, name)
        if value is not None and value < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0")
    if args.out is None:
        args.out = Path("results/reproduce_full" if args.full else "results/reproduce")
    return args


def choose_threads(requested: int | None) -> tuple[int, str]:
    """``torch.set_num_threads`` value and why: see ``--threads``."""
    if requested:
        return requested, "--threads"
    cpus = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return min(2, cpus), "load average unknown"
    if load > cpus / 2:
        return 1, f"load average {load:.1f} on {cpus} CPUs: busy machine"
    return min(2, cpus), f"load average {load:.1f} on {cpus} CPUs"


def make_plan(args: argparse.Namespace) -> Plan:
    problems = list(args.problems or (PROBLEMS if args.full else BUDGET_PROBLEMS))
    if args.optimizers:
        optimizers = {p: list(args.optimizers) for p in problems}
    elif args.full:
        optimizers = {p: list(PAPER_OPTIMIZERS[p]) for p in problems}
    else:
        optimizers = {p: list(BUDGET_OPTIMIZERS) for p in problems}
    budgets = {}
    for p in problems:
        if args.full:
            b = Budget(get_problem(p).epochs, None, None, PAPER_SEEDS)
        else:
            b = BUDGETS[p]
        if args.epochs is not None:
            b = replace(b, epochs=args.epochs)
        if args.train_size is not None:
            b = replace(b, train_size=args.train_size or None)
        if args.eval_size is not None:
            b = replace(b, eval_size=args.eval_size or None)
        budgets[p] = b
    seeds = {p: args.seeds or (PAPER_SEEDS if args.full else budgets[p].seeds) for p in problems}
    return Plan(problems, optimizers, seeds, args.full, budgets, BUDGET_HPARAMS, args.lr_grid)


def describe(plan: Plan) -> str:
    """The plan in a few lines."""
    lines = []
    for p in plan.problems:
        b = plan.budgets[p]
        head = (
            f"{p}: {b.epochs} epochs, "
            + (f"{b.train_size:,} training samples" if b.train_size else "all training samples")
            + (f", evaluation capped at {b.eval_size:,}" if b.eval_size else "")
            + f", {plan.seeds[p]} seed(s)"
        )
        if plan.full or plan.lr_grid:
            opts = ", ".join(plan.optimizers[p])
            lines.append(f"{head}; grid lr x damping, then the best setting: {opts}")
            continue
        opts = []
        for o in plan.optimizers[p]:
            lr, damping = plan.hparams[p][o]
            opts.append(f"{o} (lr {lr:g}" + (f", damping {damping:g})" if o in DAMPED else ")"))
        lines.append(f"{head}; " + ", ".join(opts))
    return "\n".join(lines)


def full_protocol_commands(out: str = "results/reproduce_full") -> list[str]:
    """The shell commands of the paper's protocol, one grid per problem and optimizer."""
    cmds = []
    for problem, opts in PAPER_OPTIMIZERS.items():
        for opt in opts:
            cmds.append(
                f"python -m experiments grid {problem} {opt} --seeds {PAPER_SEEDS} "
                f"--results-dir {out}/runs"
            )
    cmds.append(
        f"python -m experiments.overhead --problems 3c3d --rounds 25 --json {out}/overhead.json"
    )
    cmds.append(f"python -m paper_figs curves {out}/runs {out}/figures")
    cmds.append(f"python -m paper_figs overhead {out}/overhead.json {out}/figures")
    cmds.append(f"python -m paper_figs table {out}/runs {out}")
    return cmds


# --- data -------------------------------------------------------------------------------------


class _Log:
    def __init__(self):
        self.start = time.perf_counter()
        self.phases: dict[str, float] = {}

    def __call__(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.start:6.1f}s] {msg}", flush=True)

    @contextlib.contextmanager
    def phase(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - t0


def load_data(
    problems: list[str], root: Path | None, fetch: bool, synthetic: bool, log
) -> tuple[dict[str, ImageData], dict[str, str]]:
    """The data set of every problem that can be had: ``({dataset: data}, {problem: why not})``."""
    datasets: dict[str, ImageData] = {}
    missing: dict[str, str] = {}
    fetched = False
    for problem in problems:
        name = get_problem(problem).dataset
        if name in datasets:
            continue
        try:
            datasets[name] = load_dataset(name, root, synthetic)
            continue
        except DataMissingError as err:
            first_error = err
        if fetch and not fetched and name in ("mnist", "fmnist"):
            fetched = True
            log(f"{name} is missing; running `python -m experiments.fetch_data` ...")
            try:
                from . import fetch_data

                argv = [] if root is None else ["--root", str(root)]
                fetch_data.main(argv)
            except Exception as err:  # noqa: BLE001  (fetching is best effort; say why)
                log(f"fetch_data failed: {type(err).__name__}: {err}")
            try:
                datasets[name] = load_dataset(name, root, synthetic)
                continue
            except DataMissingError as err:
                first_error = err
        missing[name] = str(first_error)
    skipped = {
        p: missing[get_problem(p).dataset] for p in problems if get_problem(p).dataset in missing
    }
    for problem, why in skipped.items():
        log(f"SKIPPING {problem}: its data set is not available. {why}")
    return datasets, skipped


# --- the runs ---------------------------------------------------------------------------------


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.4f}"


def _report(log, result: dict, seconds: float) -> None:
    f = result["final"]
    state = "reused" if result.get("skipped") else result["status"]
    log(
        f"  {result['config']['optimizer']:<10} seed {result['config']['seed']}: {state:<8} "
        f"epoch {f['epoch']}: test acc {_fmt(f.get('test_acc'))}, valid acc "
        f"{_fmt(f.get('valid_acc'))}, train loss {_fmt(f.get('train_loss'))} "
        f"({seconds:.1f}s; training {result['timing']['epoch_s']:.1f}s)"
    )


def run_budgeted(plan: Plan, datasets, skipped, args, log) -> list[dict]:
    results = []
    runs_dir = args.out / "runs"
    for problem in plan.problems:
        if problem in skipped:
            continue
        b = plan.budgets[problem]
        data = datasets[get_problem(problem).dataset]
        dev = resolve_device(args.device)
        splits = make_splits(data, train_size=b.train_size, eval_size=b.eval_size, device=dev)
        log(
            f"{problem}: {len(splits.train)} training samples, {b.epochs} epochs, eval on "
            f"{len(splits.test)} test samples, {plan.seeds[problem]} seed(s), optimizers "
            f"{', '.join(plan.optimizers[problem])}" + (" [SYNTHETIC]" if splits.synthetic else "")
        )
        with log.phase(f"train {problem}"):
            if plan.lr_grid:
                for opt in plan.optimizers[problem]:
                    lr, damping = plan.hparams[problem][opt]
                    base = plan.configs(problem, args.synthetic)[0]
                    base = replace(
                        base, optimizer=opt, lr=lr, damping=damping if opt in DAMPED else None
                    )
                    t0 = time.perf_counter()
                    try:
                        summary = grid(
                            base,
                            lrs=PAPER_LRS,
                            dampings=PAPER_DAMPINGS,
                            seeds=plan.seeds[problem],
                            results_dir=runs_dir,
                            data_root=args.data_root,
                            device=args.device,
                            progress=args.progress,
                        )
                    except (SetupError, RuntimeError, FloatingPointError, ValueError) as err:
                        log(
                            f"  {opt}: grid FAILED ({type(err).__name__}): "
                            f"{str(err).splitlines()[0][:300]}"
                        )
                        continue
                    log(
                        f"  {opt}: grid best {summary['best']}, test acc "
                        f"{_fmt(summary['test_acc_mean'])} ({time.perf_counter() - t0:.1f}s)"
                    )
                    results.append(summary)
                continue
            for cfg in plan.configs(problem, args.synthetic):
                t0 = time.perf_counter()
                try:
                    result = run(
                        cfg,
                        results_dir=runs_dir,
                        data_root=args.data_root,
                        device=args.device,
                        progress=args.progress,
                        splits=splits,
                    )
                except SetupError as err:
                    log(f"  {cfg.optimizer} seed {cfg.seed}: cannot run: {err}")
                    continue
                except (RuntimeError, FloatingPointError, ValueError) as err:
                    # e.g. a Cholesky failure (torch.linalg.LinAlgError) at a too small damping:
                    # the runner writes no JSON for it; report it and go on with the next run
                    log(
                        f"  {cfg.optimizer} seed {cfg.seed}: FAILED ({type(err).__name__}): "
                        f"{str(err).splitlines()[0][:300]}"
                    )
                    continue
                _report(log, result, time.perf_counter() - t0)
                results.append(result)
    return results


def run_full(plan: Plan, skipped, args, log) -> list[dict]:
    summaries = []
    for problem in plan.problems:
        if problem in skipped:
            continue
        for opt in plan.optimizers[problem]:
            base = RunConfig(
                problem,
                opt,
                PAPER_LRS[0],
                damping=PAPER_DAMPINGS[0] if opt in DAMPED else None,
                epochs=plan.budgets[problem].epochs,
                train_size=plan.budgets[problem].train_size,
                eval_size=plan.budgets[problem].eval_size,
                synthetic=args.synthetic,
            )
            t0 = time.perf_counter()
            with log.phase(f"train {problem}"):
                try:
                    summary = grid(
                        base,
                        lrs=PAPER_LRS,
                        dampings=PAPER_DAMPINGS,
                        seeds=plan.seeds[problem],
                        results_dir=args.out / "runs",
                        data_root=args.data_root,
                        device=args.device,
                        progress=args.progress,
                    )
                except (SetupError, DataMissingError) as err:
                    log(f"{problem} / {opt}: cannot run: {err}")
                    continue
                except (RuntimeError, FloatingPointError, ValueError) as err:
                    # runner.grid stops at the first run that raises (e.g. a Cholesky failure
                    # at damping 1e-4); the runs finished so far stay on disk
                    log(
                        f"{problem} / {opt}: grid FAILED ({type(err).__name__}): "
                        f"{str(err).splitlines()[0][:300]}"
                    )
                    continue
            log(
                f"{problem} / {opt}: best {summary['best']}, test acc "
                f"{_fmt(summary['test_acc_mean'])} ± {_fmt(summary['test_acc_std'])} over "
                f"{len(summary['seeds'])} seeds ({time.perf_counter() - t0:.0f}s)"
            )
            summaries.append(summary)
    return summaries


# --- overhead table ---------------------------------------------------------------------------


def _register_second_order(names) -> list[str]:
    """Add second-order quantities to experiments.overhead's registry; returns those added."""
    from curvopt import extensions as ext

    from . import overhead

    added = []
    for name in names:
        cls = getattr(ext, name, None)
        if cls is None:
            continue
        if name not in overhead.QUANTITIES:
            overhead.register_quantity(overhead.Quantity(name, name, (cls,), order=2))
        added.append(name)
    return added


def run_overhead(args, log) -> Path | None:
    """The overhead table of 3C3D via ``experiments.overhead``; returns its JSON path."""
    path = args.out / "overhead.json"
    try:
        from . import overhead
    except Exception as err:  # noqa: BLE001  (written by someone else; fail soft)
        log(f"overhead table skipped: experiments.overhead cannot be imported: {err}")
        return None
    second = FULL_SECOND_ORDER if args.full else BUDGET_SECOND_ORDER
    try:
        second = _register_second_order(second)
    except Exception as err:  # noqa: BLE001
        log(f"second-order quantities not added to the overhead table: {err}")
        second = []
    quantities = [q for q in (*FIRST_ORDER, *second) if q in overhead.QUANTITIES]
    rounds = args.overhead_rounds or (25 if args.full else 7)
    seconds = args.overhead_seconds or (120.0 if args.full else 30.0)
    threads = args.threads
    argv = [
        "--problems",
        *OVERHEAD_PROBLEMS,
        "--quantities",
        *quantities,
        "--rounds",
        str(rounds),
        "--warmup",
        "2",
        "--max-seconds",
        str(seconds),
        "--threads",
        str(threads),
        "--json",
        str(path),
    ]
    if args.device not in ("auto", "cpu"):
        argv += ["--device", args.device]
    elif args.device == "auto" and torch.cuda.is_available():
        argv += ["--device", "cuda"]
    log("overhead table: python -m experiments.overhead " + shlex.join(argv))
    before = torch.get_num_threads()
    try:
        code = overhead.main(argv)
    except Exception as err:  # noqa: BLE001
        log(f"overhead table failed: {type(err).__name__}: {err}")
        return None
    finally:
        torch.set_num_threads(before)
    if code != 0 or not path.exists():
        log(f"overhead table failed (exit code {code})")
        return None
    return path


# --- figures, table, summary ------------------------------------------------------------------


def _budget_note(plan: Plan, synthetic: bool) -> str:
    if plan.full and not synthetic:
        return ""
    parts = []
    if synthetic:
        parts.append("**SYNTHETIC DATA** — random images and labels; these numbers mean nothing.")
    if not plan.full:
        parts.append(
            "**Budgeted run** (`python -m experiments.reproduce` default): "
            + "; ".join(
                f"{p}: {b.epochs} of {get_problem(p).epochs} epochs on "
                + (f"{b.train_size:,}" if b.train_size else "all")
                + " training samples"
                + (f", evaluated on {b.eval_size:,} samples" if b.eval_size else "")
                + f", {plan.seeds[p]} seed(s)"
                for p, b in plan.budgets.items()
            )
            + "; fixed hyper-parameters instead of the paper's grid. "
            "Not comparable with the paper; `--full` runs its protocol."
        )
    return "\n\n".join(parts)


def make_outputs(plan: Plan, args, log) -> dict[str, list[str]]:
    import paper_figs

    figures = args.out / "figures"
    written: dict[str, list[str]] = {}
    runs_dir = args.out / "runs"
    written["curves"] = [str(p) for p in paper_figs.plot_curves(runs_dir, figures)]
    overhead_json = args.out / "overhead.json"
    if overhead_json.exists():
        written["overhead"] = [str(p) for p in paper_figs.plot_overhead(overhead_json, figures)]
    table = paper_figs.write_table(runs_dir, args.out, _budget_note(plan, args.synthetic))
    written["table"] = [str(table)]
    return written


def main(argv=None) -> int:
    args = parse_args(argv)
    plan = make_plan(args)
    log = _Log()
    commands = full_protocol_commands()
    if args.dry_run:
        print(f"{'FULL protocol' if plan.full else 'Budgeted run'} into {args.out}:")
        print(describe(plan))
        print("\nThe paper's full protocol, step by step:\n  " + "\n  ".join(commands))
        print("or in one go: python -m experiments.reproduce --full")
        return 0
    args.threads, why_threads = choose_threads(args.threads)
    torch.set_num_threads(args.threads)
    if args.fresh and args.out.exists():
        for sub in ("runs", "figures"):
            shutil.rmtree(args.out / sub, ignore_errors=True)
        (args.out / "overhead.json").unlink(missing_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    log(
        f"{'FULL protocol' if plan.full else 'budgeted run'} into {args.out} "
        f"(torch {torch.__version__}, {torch.get_num_threads()} thread(s): {why_threads}; "
        f"device {args.device})" + (" [SYNTHETIC DATA]" if args.synthetic else "")
    )
    for line in describe(plan).splitlines():
        log("plan: " + line)
    with log.phase("data"):
        datasets, skipped = load_data(
            plan.problems, args.data_root, args.fetch, args.synthetic, log
        )
    if plan.full:
        results = run_full(plan, skipped, args, log)
    else:
        results = run_budgeted(plan, datasets, skipped, args, log)
    del datasets
    overhead_path = None
    if args.overhead:
        with log.phase("overhead table"):
            overhead_path = run_overhead(args, log)
    with log.phase("figures and table"):
        written = make_outputs(plan, args, log)
    total = time.perf_counter() - log.start
    summary = {
        "full": plan.full,
        "synthetic": args.synthetic,
        "plan": asdict(plan),
        "skipped_problems": skipped,
        "runs": len(results),
        "wall_clock_s": total,
        "phases_s": log.phases,
        "files": written,
        "overhead_json": str(overhead_path) if overhead_path else None,
        "full_protocol_commands": commands,
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    table_path = Path(written["table"][0])
    print("\n" + table_path.read_text())
    print(
        f"Wall-clock: {total:.0f}s ("
        + ", ".join(f"{k} {v:.0f}s" for k, v in log.phases.items())
        + ")"
    )
    print("Written:")
    for kind, paths in written.items():
        for path in paths:
            print(f"  {kind:>8}: {path}")
    if overhead_path:
        print(f"  {'overhead':>8}: {overhead_path}")
    print(f"  {'summary':>8}: {args.out / 'summary.json'}")
    if skipped:
        print("Skipped (data not available): " + ", ".join(skipped))
    if not plan.full:
        print(
            "\nThese are BUDGETED numbers, not comparable with the paper. The paper's full "
            "protocol (grid lr x damping, best by final validation accuracy, 10 seeds, full "
            "epochs, all four problems; CIFAR needs its archives in the data root):"
        )
        print("  python -m experiments.reproduce --full      # all of the below in one go")
        for cmd in commands:
            print("  " + cmd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
