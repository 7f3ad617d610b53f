"""``python -m experiments ttr`` (the grid) and ``python -m experiments ttr_cost`` (the cost per
step of its winners, re-runnable on its own)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from .. import peers
from ..commands import Command, add_threads, at_least, command_line, relative, set_threads
from ..data import DataMissingError, load_dataset, make_splits
from ..distributed import resolve_device
from ..optimizers import SetupError
from ..problems import get_problem
from .cost import measure_costs
from .grids import BATCH_SIZES, GRIDS
from .protocol import CALIBRATION_OPTIMIZER, SEEDS, TTR_PROBLEMS, reusable_runs, tune_and_run
from .report import (
    COST,
    entry_path,
    load_costs,
    load_entries,
    winner_setting,
    write_json,
    write_summary,
)

DEFAULT_DIR = "experiments/results/ttr"
OPTIMIZERS = list(dict.fromkeys(name for grids in GRIDS.values() for name in grids))
#: every batch size of a grid (the workloads' own besides BATCH_SIZES)
ALL_BATCH_SIZES = sorted(
    {s.batch_size for grids in GRIDS.values() for g in grids.values() for s in g} | set(BATCH_SIZES)
)
#: ``--quick``: a few steps, for tests and a smoke run (one seed; results into
#: :data:`QUICK_DIR` unless ``--json`` is given)
QUICK = {"max_steps": 20, "eval_every": 5, "eval_size": 256}
QUICK_DIR = Path(tempfile.gettempdir()) / "curvopt_ttr_quick"


#: the numbers of a ``/proc/cpuinfo`` entry that identify a CPU model: (field, label)
CPU_NUMBERS = (("cpu family", "family"), ("model", "model"), ("stepping", "stepping"))


def _machine(cpuinfo: str | Path = "/proc/cpuinfo") -> str:
    """The CPU model and the number of logical CPUs: ``cpuinfo``'s model name with its family,
    model and stepping numbers (a virtual machine's name may be generic, e.g. "Intel(R) Xeon(R)
    Processor": the numbers tell its models apart), else :mod:`platform`'s name."""
    model = platform.processor() or platform.machine()
    try:
        with open(cpuinfo) as f:
            first = f.read().split("\n\n", 1)[0]
    except OSError:
        first = ""
    fields = dict(
        (key.strip(), value.strip())
        for key, value in (line.split(":", 1) for line in first.splitlines() if ":" in line)
    )
    if "model name" in fields:
        numbers = ", ".join(f"{label} {fields[key]}" for key, label in CPU_NUMBERS if key in fields)
        model = fields["model name"] + (f" ({numbers})" if numbers else "")
    return f"{model}, {os.cpu_count()} logical CPUs"


def _meta(args, **extra) -> dict:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": _machine(),
        "device": str(args.device),
        "threads": args.threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": command_line(sys.argv[1:]),
        "synthetic": args.synthetic,
        **extra,
    }


def _add_data(p) -> None:
    add_threads(p, default=1)
    p.add_argument("--synthetic", action="store_true", help="random data (marked synthetic)")
    p.add_argument(
        "--data-root", default=None, help="data folder (default: $CURVOPT_DATA or ./data)"
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i]")


def _splits(problem: str, eval_size: int, args):
    prob, device = get_problem(problem), resolve_device(args.device)
    if hasattr(prob, "splits"):  # a workload of experiments.workloads: its own data
        return prob.splits(args.data_root, args.synthetic, eval_size, device)
    data = load_dataset(prob.dataset, args.data_root, args.synthetic)
    return make_splits(data, eval_size=eval_size, device=device)


def _guarded(run):
    def execute(args) -> int:
        try:
            return run(args)
        except (DataMissingError, SetupError, ValueError, FloatingPointError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2

    return execute


TTR_DESCRIPTION = """\
Time to result: steps until a fixed test accuracy (mnist_logreg 0.92 within 1,000 steps,
fmnist_2c2d 0.88 and 0.90 within 1,500; steps at batch 128, the same data at other batch sizes),
evaluated off the clock every 25 steps. Every optimizer tries its committed settings (4 at each
batch size; fmnist_2c2d: 4 at 128, 2 at 512 for some) with seed 0 (each run stops at the
highest target); per batch size the one with the fewest steps to the highest target (ties: to
the lower ones) wins, across batch sizes and among settings still tied the one with the least
steps x interleaved cost per step; it runs the other seeds (fmnist_vit: 0.84 and 0.86 within
1,500, fixed from Adam's calibration). Writes one JSON per problem and optimizer into --json,
after each, so an interrupted grid keeps what it did; then the summary with the costs of an
earlier ttr_cost where they match the winners.

Two workloads measure a loss, lower is better: fortunes_gpt (a character GPT on Debian's
fortunes, bits per character on held-out fortunes, batch 32) and mnist_autoencoder (the deep
autoencoder, squared reconstruction error per test image, batch 128); cap 2,000 steps, targets
from Adam's calibration at 1,000 (experiments/workloads.py). --quick: a smoke run (a few steps of
every setting, one seed, a tiny evaluation) into a scratch folder.

examples:
  OMP_NUM_THREADS=1 nice python -m experiments ttr --problems mnist_logreg
  OMP_NUM_THREADS=1 nice python -m experiments ttr --problems fmnist_2c2d --optimizers adam kfac
  OMP_NUM_THREADS=1 nice python -m experiments ttr --problems fmnist_2c2d --optimizers adam --resume
  python -m experiments ttr --quick --problems fortunes_gpt mnist_autoencoder   # smoke run
  python -m experiments ttr_cost --from experiments/results/ttr      # cost per step, the table
  python -m paper_figs ttr experiments/results/ttr experiments/results/ttr   # the figure
"""


def add_ttr_arguments(p) -> None:
    p.add_argument(
        "--problems",
        nargs="+",
        choices=list(TTR_PROBLEMS),
        default=list(TTR_PROBLEMS),
        help="problems to run",
    )
    p.add_argument(
        "--optimizers", nargs="+", choices=OPTIMIZERS, default=OPTIMIZERS, help="optimizers to tune"
    )
    p.add_argument(
        "--seeds", type=at_least(1), default=None, help=f"seeds of the winner ({SEEDS}; --quick: 1)"
    )
    p.add_argument(
        "--batch-sizes",
        nargs="+",
        type=at_least(1),
        choices=ALL_BATCH_SIZES,
        default=list(ALL_BATCH_SIZES),
        help="tune at these batch sizes of the grid only",
    )
    p.add_argument(
        "--settings",
        nargs="+",
        type=at_least(0),
        metavar="I",
        help="tune these settings of the grid only (0-based, in the grid's order)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="take the runs of the existing JSON of the same spec (same setting and seed) "
        "instead of training them again",
    )
    p.add_argument("--max-steps", type=at_least(1), help="override every problem's step cap")
    p.add_argument("--eval-every", type=at_least(1), help="override the evaluation cadence")
    p.add_argument("--eval-size", type=at_least(1), help="override the test subset size")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: "
        + ", ".join(f"{k} {v}" for k, v in QUICK.items())
        + f", 1 seed, heavyball eager, into {QUICK_DIR} unless --json is given",
    )
    p.add_argument(
        "--json", default=None, metavar="DIR", help=f"folder of the JSON files ({DEFAULT_DIR})"
    )
    _add_data(p)


def _spec(problem: str, args):
    overrides = dict(QUICK) if args.quick else {}
    given = {"max_steps": args.max_steps, "eval_every": args.eval_every}
    given["eval_size"] = args.eval_size
    overrides.update({k: v for k, v in given.items() if v is not None})
    return replace(TTR_PROBLEMS[problem], **overrides)


def _grid(problem: str, optimizer: str, args) -> tuple:
    """The grid's settings at ``--batch-sizes``, only those of ``--settings`` if given."""
    grid = GRIDS[problem][optimizer]
    chosen = range(len(grid)) if args.settings is None else args.settings
    if any(i >= len(grid) for i in chosen):
        raise ValueError(
            f"{problem} {optimizer}: --settings {max(chosen)} is past its grid of {len(grid)} "
            f"settings (0 to {len(grid) - 1})"
        )
    return tuple(grid[i] for i in chosen if grid[i].batch_size in args.batch_sizes)


@_guarded
def execute_ttr(args) -> int:
    set_threads(args.threads)
    if args.seeds is None:
        args.seeds = 1 if args.quick else SEEDS
    if args.json is None:
        args.json = str(QUICK_DIR) if args.quick else DEFAULT_DIR
    if not args.quick:
        return _run_ttr(args)
    compile_modes = peers.COMPILE_MODES
    peers.COMPILE_MODES = ()  # a smoke run: heavyball eager (its compilation takes minutes)
    try:
        return _run_ttr(args)
    finally:
        peers.COMPILE_MODES = compile_modes


def _run_ttr(args) -> int:
    for problem in args.problems:
        spec = _spec(problem, args)
        if not spec.targets and set(args.optimizers) != {CALIBRATION_OPTIMIZER}:
            raise ValueError(
                f"{problem} has no targets yet: run --problems {problem} --optimizers "
                f"{CALIBRATION_OPTIMIZER} first and write its proposed_targets into TTR_PROBLEMS"
            )
        splits = _splits(problem, spec.eval_size, args)
        for optimizer in args.optimizers:
            if optimizer not in GRIDS[problem]:
                _log(f"{problem}: no grid for {optimizer}, skipped")
                continue
            grid = _grid(problem, optimizer, args)
            if not grid:
                _log(f"{problem} {optimizer}: no setting of its grid at these batch sizes, skipped")
                continue
            path = entry_path(args.json, problem, optimizer, not spec.targets)
            old = json.loads(path.read_text()) if args.resume and path.is_file() else None
            done = reusable_runs(old, problem, spec)
            entry = tune_and_run(problem, grid, spec, splits, args.seeds, log=_log, done=done)
            entry["meta"] = _meta(args)
            if entry["reused_runs"]:
                entry["meta"]["earlier"] = old.get("meta")
            write_json(path, entry)
    rows, path = write_summary(args.json, _meta(args))
    print(f"written: {relative(path)}")
    return 0


TTR_COST_DESCRIPTION = """\
Cost per step of the winners of a ttr results folder, measured interleaved in one process: per
problem, each winner's blocks of L steps (L: the least common multiple of the curvature,
inverse and basis intervals, so a block holds its share of curvature steps) alternate
round-robin on the same fixed batches, --rounds times after a warm-up round; the cost is the
median block mean. Writes cost.json, then summary.json and ttr.md (steps x cost, ratios to
Adam). Re-run it after a change of the step's speed: the steps to the targets stay valid.

example: OMP_NUM_THREADS=1 python -m experiments ttr_cost --from experiments/results/ttr
"""


def add_cost_arguments(p) -> None:
    p.add_argument("--from", dest="folder", default=DEFAULT_DIR, metavar="DIR", help="results")
    p.add_argument("--problems", nargs="+", choices=list(TTR_PROBLEMS), help="default: all there")
    p.add_argument("--rounds", type=at_least(1), default=5, help="counted rounds")
    p.add_argument("--warmup", type=at_least(0), default=1, help="rounds not counted")
    _add_data(p)


@_guarded
def execute_cost(args) -> int:
    set_threads(args.threads)
    entries = load_entries(args.folder)
    if not entries:
        raise ValueError(f"no ttr results in {args.folder}: run python -m experiments ttr first")
    problems = args.problems or list(dict.fromkeys(e["problem"] for e in entries))
    start, measured = _meta(args), {}
    for problem in problems:
        winners = {
            e["optimizer"]: winner_setting(e)
            for e in entries
            if e["problem"] == problem and e["spec"]["targets"]  # not a calibration entry
        }
        if not winners:
            raise ValueError(f"no ttr results for {problem} in {args.folder}")
        splits = _splits(problem, 1, args)
        meta = _meta(args)
        _log(f"{problem} cost on {meta['machine']}, torch {meta['torch']}, threads {args.threads}")
        measured[problem] = measure_costs(
            problem, winners, splits, args.rounds, args.warmup, log=_log
        )
        measured[problem]["meta"] = meta
    # problems not measured now keep their last measurement (each with the meta of its run),
    # read only now: a ttr_cost of other problems that ended meanwhile keeps its own
    earlier = load_costs(args.folder).get("problems", {})
    write_json(Path(args.folder) / COST, {"meta": start, "problems": {**earlier, **measured}})
    rows, path = write_summary(args.folder, _meta(args))
    print(f"written: {relative(path)}")
    return 0


def _log(line: str) -> None:
    print(line, flush=True)


TTR = Command(
    "ttr",
    "time to result: steps to fixed test accuracies, tuned",
    TTR_DESCRIPTION,
    add_ttr_arguments,
    execute_ttr,
)
TTR_COST = Command(
    "ttr_cost",
    "time to result: cost per step of the winners, interleaved in one process",
    TTR_COST_DESCRIPTION,
    add_cost_arguments,
    execute_cost,
    aliases=("ttr-cost",),
)
