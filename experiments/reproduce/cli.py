"""Command line of the main job: ``python -m experiments reproduce [--full] [--dry-run] ...``
(also ``python -m experiments reproduce``)."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from ..commands import Command, add_threads, at_least, choose_threads, relative
from ..data import default_root
from ..optimizers import OPTIMIZERS
from .jobs import Log, load_data, run_budgeted, run_full
from .overhead_table import run_overhead
from .plan import (
    BUDGET_OPTIMIZERS,
    BUDGET_PROBLEMS,
    PAPER_OPTIMIZERS,
    PAPER_SEEDS,
    describe,
    full_protocol_commands,
    make_plan,
)
from .report import make_outputs


DESCRIPTION = """\
The main job (what make run runs): the BackPACK paper's optimizer experiments (Dangel, Kunstner,
Hennig, ICLR 2020) on real data, budgeted by default so that it fits in about 7 minutes on 2
CPU cores. It fetches MNIST and Fashion-MNIST when missing, trains mnist_logreg (2 epochs) and
fmnist_2c2d (3 epochs on 1024 images) with momentum, Adam, DiagGGN-MC and KFAC (fixed
hyper-parameters, 3 seeds), measures the overhead table of 3C3D, and writes the figures and a
table of final test accuracies next to the paper's into OUT. Without --full every number is
budgeted and marked as not comparable with the paper.

--full runs the paper's whole protocol instead: all four problems, the optimizers the paper ran
on each, the grid lr in {1e-4 .. 1} x damping in {1e-4 .. 10}, the best setting by final
validation accuracy rerun with 10 seeds, full epochs and training sets, the full overhead table
(days on a CPU; use a GPU). --dry-run prints the plan and the full protocol's commands.

Everything goes below OUT: runs/ (one JSON per run; started again, finished runs are reused),
overhead.json, figures/*.png, comparison.md and summary.json.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--full",
        action="store_true",
        help="the paper's whole protocol: grid, 10 seeds, full epochs, all four problems",
    )
    p.add_argument(
        "--out",
        type=Path,
        help="output folder (default results/reproduce, results/reproduce_full with --full)",
    )
    p.add_argument(
        "--problems",
        nargs="+",
        choices=list(PAPER_OPTIMIZERS),
        metavar="PROBLEM",
        help=f"of {', '.join(PAPER_OPTIMIZERS)} (default: {' '.join(BUDGET_PROBLEMS)}; "
        "--full: all four)",
    )
    p.add_argument(
        "--optimizers",
        nargs="+",
        choices=list(OPTIMIZERS),
        metavar="OPTIMIZER",
        help=f"of {', '.join(OPTIMIZERS)} (default: {' '.join(BUDGET_OPTIMIZERS)}; --full: the "
        "paper's per problem)",
    )
    p.add_argument(
        "--seeds",
        type=at_least(1),
        help=f"seeds per setting (default 3, CIFAR 1; --full: {PAPER_SEEDS})",
    )
    p.add_argument("--epochs", type=at_least(1), help="override the epochs of every problem")
    p.add_argument(
        "--train-size",
        type=at_least(0),
        help="override the training subset of every problem (0: the whole training set)",
    )
    p.add_argument(
        "--eval-size", type=at_least(0), help="override the evaluation cap (0: no cap)"
    )
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
        help="do not run fetch_data when a data set is missing",
    )
    p.add_argument(
        "--no-overhead", dest="overhead", action="store_false", help="skip the overhead table"
    )
    p.add_argument(
        "--overhead-rounds", type=at_least(1), help="interleaved rounds (default 7; --full 25)"
    )
    p.add_argument(
        "--overhead-seconds",
        type=float,
        help="time limit of the overhead rounds per network (default 30; --full 120)",
    )
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, ...")
    add_threads(p, default=None)
    p.add_argument(
        "--fresh",
        action="store_true",
        help="delete this output folder's earlier runs first (default: reuse them)",
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bars with the time left of each epoch, evaluation and run (default: "
        "when stderr is a terminal)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the plan and the commands only")


def _resolved(args: argparse.Namespace) -> argparse.Namespace:
    if args.progress is None:
        args.progress = sys.stderr.isatty()
    if args.out is None:
        args.out = Path("results/reproduce_full" if args.full else "results/reproduce")
    return args


def parse_args(argv=None) -> argparse.Namespace:
    return _resolved(REPRODUCE.parser().parse_args(argv))


def execute(args: argparse.Namespace) -> int:
    args = _resolved(args)
    plan = make_plan(args)
    log = Log()
    commands = full_protocol_commands()
    if args.dry_run:
        print(f"{'FULL protocol' if plan.full else 'Budgeted run'} into {args.out}:")
        print(describe(plan))
        print("\nThe paper's full protocol, step by step:\n  " + "\n  ".join(commands))
        print("or in one go: python -m experiments reproduce --full")
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
        "files": {kind: [relative(p) for p in paths] for kind, paths in written.items()},
        "overhead_json": relative(overhead_path) if overhead_path else None,
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
        print("  python -m experiments reproduce --full      # all of the below in one go")
        for cmd in commands:
            print("  " + cmd)
    return 0


REPRODUCE = Command(
    "reproduce",
    "the main job (make run): budgeted reproduction of the BackPACK paper, figures, table",
    DESCRIPTION,
    add_arguments,
    execute,
)


def main(argv=None) -> int:
    return REPRODUCE.main(argv)
