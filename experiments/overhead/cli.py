"""``python -m experiments overhead``: the command, its options and its tables.

    python -m experiments overhead                       # default: all problems, all backends found
    python -m experiments overhead --problems 3c3d --json overhead.json
    python -m experiments overhead --cases backpack --batch 8 --threads 1   # against BackPACK
    python -m experiments overhead --problems gpt --quantities BatchGrad DiagGGNMC
    python -m experiments overhead --profile 3c3d:Variance   # torch.profiler table of one case
    python -m experiments overhead --cases backpack --problems logreg --calls   # calls a step
    python -m experiments overhead --cases backpack --problems logreg --operators   # operators
    python -m experiments overhead --cases curvlinops --memory   # + peak MB, fresh processes
    python -m experiments overhead --cases backpack --floors     # + each cell's floor

(``python -m experiments.overhead`` is the same command.) What is measured and how:
:mod:`experiments.overhead`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch

from ..commands import Command, add_threads
from .backends import BACKENDS
from . import floors as floor_model
from .cases import BACKPACK_CASES, CURVLINOPS_CASES, DEFAULT_CASES, EXTRA_CASES, PLAIN, QUANTITIES
from .memory import measure_memory, unsupported_reason
from .problems import PROBLEMS
from .report import (
    FLOORS_NOTE,
    MEMORY_NOTE,
    TARGETS_NOTE,
    markdown_table,
    memory_table,
    payload,
)
from .timing import Result, measure, profile, python_calls, torch_operators

#: named case sets (``--cases``)
CASE_SETS = {
    "default": DEFAULT_CASES + EXTRA_CASES,
    "backpack": BACKPACK_CASES,
    "curvlinops": CURVLINOPS_CASES,
}


DESCRIPTION = """\
Overhead of curvopt's quantities: the time of a forward+backward pass that also computes a
quantity, as a ratio to the plain forward+backward pass, median over interleaved rounds. Every
case (problem, quantity) runs on every backend that can compute it: curvopt, torch.func, and
Opacus and BackPACK when importable (make reference installs them; README, "Reference
libraries"); curvlinops gets a column for Kronecker factors and GGN matvecs. With --memory,
a second table gives each case's peak memory in MB, each measured in a fresh process. With
--floors, each row also gets the floor of its extra work (GFLOP, MB, ms at the sgemm rate and
copy bandwidth measured in the same process) and curvopt's measured extra time over it. The
"target (curvopt)" column is the ratio the project set as curvopt's goal for
that cell (at the problem's own batch size); the lines below the table explain the marks.

examples:
  python -m experiments overhead                     # all problems, every backend found
  python -m experiments overhead --cases backpack --batch 8 --threads 1   # against BackPACK
  python -m experiments overhead --problems gpt --quantities BatchGrad DiagGGNMC
  python -m experiments overhead --profile 3c3d:Variance   # torch.profiler table of one case
  python -m experiments overhead --cases backpack --problems logreg --calls   # calls a step
  python -m experiments overhead --cases backpack --problems logreg --operators   # operators
  python -m experiments overhead --cases curvlinops --memory   # against curvlinops, + memory
  python -m experiments overhead --cases backpack --floors     # + floors in flops and bytes
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cases",
        choices=list(CASE_SETS),
        default="default",
        help="the case set: 'default' (first order on 3C3D, MLP, CNN, transformer; second "
        "order on 3C3D and MLP), 'backpack' (DeepOBS logreg, 2C2D, 3C3D, every second-order "
        "quantity and per-sample gradients: the comparison with BackPACK) or 'curvlinops' "
        "(KFAC/KFLR factors and GGN matvecs on 2C2D and the GPT-style decoder)",
    )
    p.add_argument(
        "--problems",
        nargs="+",
        default=None,
        choices=list(PROBLEMS),
        help="default: the problems of the case set; e.g. 'gpt' (GPT-style decoder) needs "
        "--quantities",
    )
    p.add_argument(
        "--batch", type=int, default=None, help="batch size of every problem (default: its own)"
    )
    p.add_argument(
        "--quantities",
        nargs="+",
        default=None,
        choices=[q for q in QUANTITIES if q != PLAIN],
        help="default: " + " ".join(dict.fromkeys(q for _, q in DEFAULT_CASES)),
    )
    p.add_argument(
        "--backends",
        nargs="+",
        default=None,
        choices=list(BACKENDS),
        help="default: every backend that is importable",
    )
    add_threads(p, default=2)
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    p.add_argument("--rounds", type=int, default=25, help="interleaved rounds")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps per case")
    p.add_argument(
        "--min-sample-ms",
        type=float,
        default=15.0,
        help="calls of a step per sample, enough to last about this long; the fastest counts",
    )
    p.add_argument(
        "--max-seconds",
        type=float,
        default=15.0,
        help="stop a problem's rounds after this long, at least 3 rounds",
    )
    p.add_argument(
        "--max-other-load",
        type=float,
        default=None,
        help="drop rounds in which other processes used more than this share (0-1) of the CPUs",
    )
    p.add_argument("--seed", type=int, default=0, help="weights and batches")
    p.add_argument(
        "--spread", action="store_true", help="show the quartiles of the ratios in each cell"
    )
    p.add_argument(
        "--memory",
        action="store_true",
        help="also measure each case's peak memory (MB), each in a fresh process (Linux)",
    )
    p.add_argument(
        "--floors",
        action="store_true",
        help="add each cell's floor: a lower bound of its extra work over the plain step in "
        "GFLOP and MB, as ms at the measured sgemm rate and copy bandwidth, and curvopt's "
        "measured extra time over it (experiments/overhead/floors.py)",
    )
    p.add_argument("--no-timing", action="store_true", help="skip the timing table (with --memory)")
    p.add_argument("--json", type=Path, help="also write all timings to this JSON file")
    p.add_argument(
        "--profile",
        metavar="PROBLEM:QUANTITY[:BACKEND]",
        help="print a torch.profiler table of one case instead of the ratio table",
    )
    p.add_argument(
        "--calls",
        action="store_true",
        help="print the Python calls a step of each case makes (cProfile's count, mean of "
        "20 steps) instead of the ratio table: deterministic where times scatter",
    )
    p.add_argument(
        "--operators",
        action="store_true",
        help="print the torch (ATen) operators a step of each case dispatches (mean of 20 "
        "steps) instead of the ratio table",
    )


def execute(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)
    if args.profile:
        parts = args.profile.split(":")
        print(f"torch.set_num_threads({torch.get_num_threads()})")
        print(profile(*parts, device=args.device, batch=args.batch))
        return 0

    backends = []
    skipped = {}
    for name in args.backends or list(BACKENDS):
        reason = BACKENDS[name].available()
        if reason is None:
            backends.append(name)
        else:
            skipped[name] = reason
            log(f"backend {name} skipped: {reason}")
    case_set = CASE_SETS[args.cases]
    problems = args.problems or list(
        dict.fromkeys(p for p, q in case_set if (p, q) not in EXTRA_CASES)
    )
    if args.quantities:
        cases = [(p, q) for p in problems for q in args.quantities]
    else:
        cases = [(p, q) for p, q in case_set if p in problems]
    if args.calls or args.operators:
        print(calls_table(problems, cases, backends, args.batch, args.device, args.operators))
        return 0
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan

    results: list[Result] = []
    infos: dict[str, dict] = {}
    for i, pname in enumerate(problems if not args.no_timing else []):
        quantities = [q for p, q in cases if p == pname]
        problem = PROBLEMS[pname] if args.batch is None else PROBLEMS[pname].resized(args.batch)
        res, info = measure(
            problem,
            quantities,
            backends,
            args.rounds,
            args.warmup,
            args.min_sample_ms / 1e3,
            args.max_seconds,
            args.seed + i,
            log,
            args.device,
            args.max_other_load,
        )
        results += res
        infos[pname] = info
        for r in res:
            if r.error and not r.error.startswith("n/a"):
                log(f"{pname}/{r.quantity}/{r.backend}: {r.error}")

    floors, calibration = None, None
    if args.floors:
        floors, calibration = cell_floors(cases, args.batch), floor_model.calibrate()

    memory = []
    memory_skipped = None
    if args.memory:
        memory_skipped = unsupported_reason()
        if args.device != "cpu":
            memory_skipped = "resident memory is host memory: peak memory is measured on cpu"
        for pname in problems if memory_skipped is None else []:
            quantities = [q for p, q in cases if p == pname]
            memory += measure_memory(pname, quantities, backends, args.threads, args.batch, log)

    for name, reason in skipped.items():
        print(f"{name}: column omitted, {reason}.")
    if infos:
        print_timing(args, backends, results, infos, load, floors, calibration)
    if args.memory:
        print()
        if memory_skipped is not None:
            print(f"Peak memory not measured: {memory_skipped}.")
        else:
            print(f"Peak memory (MB), torch.set_num_threads({args.threads}), float32, cpu:\n")
            print(memory_table(memory, backends))
            print("\n" + MEMORY_NOTE)

    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        data = payload(
            args,
            backends,
            skipped,
            infos,
            results,
            load,
            memory,
            memory_skipped,
            floors,
            calibration,
        )
        args.json.write_text(json.dumps(data, indent=1))
        log(f"wrote {args.json}")
    return 0


def cell_floors(cases, batch: int | None) -> dict[tuple[str, str], floor_model.Floor]:
    """The floor of every case that has one (at ``batch``, default each problem's own)."""
    floors = {}
    for pname, q in cases:
        problem = PROBLEMS[pname] if batch is None else PROBLEMS[pname].resized(batch)
        try:
            floors[(pname, q)] = floor_model.floor(problem, q)
        except ValueError as e:  # a quantity or network the floor model does not count
            print(f"{pname}/{q}: no floor ({e})", file=sys.stderr, flush=True)
    return floors


def print_timing(args, backends, results, infos, load, floors=None, calibration=None) -> None:
    """The timing table with its header line and legend (and floors)."""
    print(
        f"Overhead: median over interleaved rounds of (step time / plain forward+backward "
        f"time in the same round); torch {torch.__version__}, "
        f"torch.set_num_threads({torch.get_num_threads()}), "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}, float32, {args.device} "
        f"({os.cpu_count()} CPUs, load average {load:.1f} at start); rounds per problem "
        f"(and the median share of the CPUs other processes used meanwhile): "
        + ", ".join(
            f"{p} {i['rounds']}"
            + (
                f" ({100 * i['other_load_median']:.0f}%)"
                if i["other_load_median"] is not None
                else ""
            )
            for p, i in infos.items()
        )
    )
    print()
    resized = args.batch is not None and any(PROBLEMS[p].batch_size != args.batch for p in infos)
    targets = {} if resized else None  # the targets hold for the problems' own batch sizes
    table = markdown_table(
        results, infos, backends, args.spread, targets, floors=floors, calibration=calibration
    )
    print(table)
    if targets is None:
        print("\n" + TARGETS_NOTE)
    if floors is not None:
        print(
            f"\nCalibration at torch.set_num_threads({calibration.threads}): sgemm "
            f"{calibration.flops_per_s / 1e9:.1f} GFLOP/s, copy "
            f"{calibration.bytes_per_s / 1e9:.1f} GB/s.\n" + FLOORS_NOTE
        )


def calls_table(problems, cases, backends, batch, device: str, operators: bool = False) -> str:
    """The Python calls a step of each case makes (``operators``: the torch operators it
    dispatches), one column per backend, ``n/a`` where a backend cannot compute the case
    (``timing.python_calls``, ``timing.torch_operators``)."""
    counted = (
        "torch operators a step (ATen operators below autograd, views and host reads included"
        if operators
        else "Python calls a step (cProfile's count, Python functions and builtins"
    )
    lines = [
        f"{counted}; mean of 20 steps after 5), torch.set_num_threads({torch.get_num_threads()}),"
        f" {device}:",
        "",
        "| problem | quantity | " + " | ".join(backends) + " |",
        "|---|---|" + "---|" * len(backends),
    ]
    for pname in problems:
        problem = PROBLEMS[pname] if batch is None else PROBLEMS[pname].resized(batch)
        quantities = [q for p, q in cases if p == pname]
        found = (torch_operators if operators else python_calls)(
            problem, quantities, backends, device
        )
        plain = f"{found[('plain', PLAIN)]:,.0f}"
        lines.append(f"| {pname} | {PLAIN} | " + " | ".join(plain for _ in backends) + " |")
        for qname in quantities:
            counts = (found.get((b, qname)) for b in backends)
            cells = ("n/a" if c is None else f"{c:,.0f}" for c in counts)
            lines.append(f"| {pname} | {qname} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


OVERHEAD = Command(
    "overhead",
    "cost of each quantity relative to a plain forward+backward pass",
    DESCRIPTION,
    add_arguments,
    execute,
)


def parse_args(argv=None) -> argparse.Namespace:
    return OVERHEAD.parser().parse_args(argv)


def main(argv=None) -> int:
    return OVERHEAD.main(argv)
