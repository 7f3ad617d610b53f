"""``python -m experiments ttr ...``: run the time-to-result benchmark and write its JSON."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
from dataclasses import asdict, replace

import torch

from .commands import Command, add_threads, command_line, set_threads
from .data import DataMissingError, load_dataset, make_splits
from .distributed import resolve_device
from .optimizers import SetupError
from .problems import get_problem
from .ttr import ENTRIES, SEEDS, TTR_PROBLEMS, tune_and_run
from .ttr_report import markdown_table, summarize, write_results

DEFAULT_OUT = "experiments/results"


def _entry(text: str) -> tuple[str, str | None]:
    """``kfac:practical`` -> ``("kfac", "practical")``; ``adam`` -> ``("adam", None)``."""
    name, _, preset = text.partition(":")
    entry = (name, preset or None)
    if entry not in ENTRIES:
        choices = ", ".join(n + (f":{p}" if p else "") for n, p in ENTRIES)
        raise argparse.ArgumentTypeError(f"unknown entry {text!r}; choose from {choices}")
    return entry


DESCRIPTION = """\
Time-to-result benchmark: wall-clock training time until the test accuracy reaches a fixed
target (mnist_logreg 0.90 within 8 s of training, fmnist_2c2d 0.75 within 25 s). Every
optimizer tries its two committed settings with seed 0 for the whole time cap; the best by final
validation accuracy then runs the other seeds, each stopping at the target. The training clock
stops during evaluation. Results are rewritten after every optimizer, so an interrupted
benchmark keeps what it did.

examples:
  OMP_NUM_THREADS=1 nice python -m experiments ttr        # the committed results, ~25 minutes
  python -m experiments ttr --problems mnist_logreg --entries adam kfac:practical
  python -m paper_figs ttr experiments/results experiments/results   # the figures
"""


def add_arguments(p) -> None:
    names = " ".join(n + (f":{p}" if p else "") for n, p in ENTRIES)
    p.add_argument(
        "--problems",
        nargs="+",
        choices=list(TTR_PROBLEMS),
        default=list(TTR_PROBLEMS),
        help="problems to run",
    )
    p.add_argument(
        "--entries",
        nargs="+",
        type=_entry,
        default=list(ENTRIES),
        metavar="OPTIMIZER[:PRESET]",
        help=f"optimizers to run (default: all: {names})",
    )
    p.add_argument("--seeds", type=int, default=SEEDS, help="seeds of the tuned setting")
    add_threads(p, default=1)
    p.add_argument("--time-cap", type=float, help="override every problem's training-time cap (s)")
    p.add_argument("--eval-every", type=float, help="override the evaluation cadence (s)")
    p.add_argument("--eval-size", type=int, help="override the test/validation subset size")
    p.add_argument("--out", default=DEFAULT_OUT, help="output folder of the JSON files")
    p.add_argument("--synthetic", action="store_true", help="random data (marked synthetic)")
    p.add_argument(
        "--data-root", default=None, help="data folder (default: $CURVOPT_DATA or ./data)"
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i]")


def _spec(problem: str, args):
    spec = TTR_PROBLEMS[problem]
    overrides = {
        "time_cap_s": args.time_cap,
        "eval_every_s": args.eval_every,
        "eval_size": args.eval_size,
    }
    return replace(spec, **{k: v for k, v in overrides.items() if v is not None})


def _machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    return f"{model}, {os.cpu_count()} logical CPUs"


def execute(args) -> int:
    try:
        return _execute(args)
    except (DataMissingError, SetupError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def _execute(args) -> int:
    set_threads(args.threads)
    device = resolve_device(args.device)
    specs = {p: _spec(p, args) for p in args.problems}
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": _machine(),
        "device": str(device),
        "threads": args.threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": command_line(sys.argv[1:]),
        "synthetic": args.synthetic,
        "problems": {p: asdict(s) for p, s in specs.items()},
    }
    rows, search = [], []
    for problem, spec in specs.items():
        data = load_dataset(get_problem(problem).dataset, args.data_root, args.synthetic)
        splits = make_splits(data, eval_size=spec.eval_size, device=device)
        for optimizer, preset in args.entries:
            tried, scored = tune_and_run(
                problem, optimizer, preset, spec, splits, seeds=args.seeds, log=_log
            )
            search += tried
            rows += scored
            path = write_results(args.out, rows, search, meta)
    print(markdown_table(summarize(rows)))
    print(f"written: {path}")
    return 0


def _log(line: str) -> None:
    print(line, flush=True)


TTR = Command(
    "ttr",
    "time-to-result benchmark: training seconds until a fixed test accuracy",
    DESCRIPTION,
    add_arguments,
    execute,
)
