"""Overhead of curvopt's quantities, as ratios to a plain forward+backward pass.

    python -m experiments overhead                       # default: all problems, all backends found
    python -m experiments overhead --problems 3c3d --json overhead.json
    python -m experiments overhead --cases backpack --batch 8 --threads 1   # against BackPACK
    python -m experiments overhead --problems gpt --quantities BatchGrad DiagGGNMC
    python -m experiments overhead --profile 3c3d:Variance   # torch.profiler table of one case
    python -m experiments overhead --cases curvlinops --memory   # + peak MB, fresh processes

(``python -m experiments.overhead`` is the same command.)

Every *case* is a (problem, quantity) pair, run by every *backend* that can compute it; the
jobs live in their own modules:

* :mod:`experiments.overhead_cases`    problems, quantities, default cases, targets
* :mod:`experiments.overhead_backends` curvopt, torch.func, Opacus, BackPACK, curvlinops (and
                                       the baseline)
* :mod:`experiments.overhead_timing`   interleaved timing, profiling
* :mod:`experiments.overhead_memory`   peak memory per case, each in a fresh process
* :mod:`experiments.overhead_report`   markdown tables (with ``curvopt/BackPACK``,
                                       ``curvopt/curvlinops`` and their geometric means when
                                       those are importable), JSON

Each backend works on its own copy of the network (same weights, same batch). The table shows
the median over interleaved rounds of the per-round ratio to the plain step (``--spread`` adds
quartiles; JSON has them, the raw times, and how busy other processes kept the CPUs in each
round; ``--max-other-load`` drops busy rounds). ``torch.set_num_threads`` is fixed
(``--threads``, default 2) and printed. Run as a command, ``OMP_WAIT_POLICY=PASSIVE`` is set
unless the variable is set: with spinning OpenMP workers a busy machine makes 2-thread steps
erratically 5-100x slower.

Competitors are optional (``make reference`` installs them without replacing the CPU torch);
a backend that is not importable loses its column, and one line says why. Opacus and BackPACK
also need no install into the project's environment:
``pip install --no-deps --target DIR opacus backpack-for-pytorch`` and ``PYTHONPATH=DIR``
(their imports need neither torchvision nor their other dependencies; delete the top-level
``benchmarks``/``examples`` folders the Opacus wheel puts into DIR).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

if __name__ == "__main__":
    # Spinning OpenMP workers turn every parallel region into a wait for a preempted thread
    # on a busy machine (2-thread steps 5-100x slower, erratically); sleeping workers keep
    # the timings stable. Must be set before torch loads OpenMP; export it to override.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # ``benchmarks`` is a folder next to ``experiments``
    sys.path.insert(0, str(_ROOT))

from experiments.overhead_backends import (  # noqa: E402
    BACKENDS,
    Backend,
    Instance,
    PlainBackend,
    Step,
    Unsupported,
)
from experiments.overhead_cases import (  # noqa: E402
    BACKPACK_CASES,
    CURVLINOPS_CASES,
    DEFAULT_CASES,
    EXTRA_CASES,
    PLAIN,
    PROBLEMS,
    QUANTITIES,
    TARGETS,
    Problem,
    Quantity,
    register_quantity,
)
from experiments.commands import Command, add_threads  # noqa: E402
from experiments.overhead_memory import measure_memory, unsupported_reason  # noqa: E402
from experiments.overhead_report import (  # noqa: E402
    MEMORY_NOTE,
    TARGETS_NOTE,
    markdown_table,
    memory_table,
    payload,
)
from experiments.overhead_timing import Result, build_steps, measure, profile  # noqa: E402

__all__ = [
    "BACKENDS",
    "BACKPACK_CASES",
    "CURVLINOPS_CASES",
    "DEFAULT_CASES",
    "EXTRA_CASES",
    "PLAIN",
    "PROBLEMS",
    "QUANTITIES",
    "TARGETS",
    "Backend",
    "Instance",
    "PlainBackend",
    "Problem",
    "Quantity",
    "Result",
    "Step",
    "Unsupported",
    "build_steps",
    "main",
    "markdown_table",
    "measure",
    "parse_args",
    "profile",
    "register_quantity",
]


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
a second table gives each case's peak memory in MB, each measured in a fresh process. The
"target (curvopt)" column is the ratio the project set as curvopt's goal for
that cell (at the problem's own batch size); the lines below the table explain the marks.

examples:
  python -m experiments overhead                     # all problems, every backend found
  python -m experiments overhead --cases backpack --batch 8 --threads 1   # against BackPACK
  python -m experiments overhead --problems gpt --quantities BatchGrad DiagGGNMC
  python -m experiments overhead --profile 3c3d:Variance   # torch.profiler table of one case
  python -m experiments overhead --cases curvlinops --memory   # against curvlinops, + memory
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
    p.add_argument("--no-timing", action="store_true", help="skip the timing table (with --memory)")
    p.add_argument("--json", type=Path, help="also write all timings to this JSON file")
    p.add_argument(
        "--profile",
        metavar="PROBLEM:QUANTITY[:BACKEND]",
        help="print a torch.profiler table of one case instead of the ratio table",
    )


def execute(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)
    if args.profile:
        parts = args.profile.split(":")
        print(f"torch.set_num_threads({torch.get_num_threads()})")
        print(profile(*parts, device=args.device))
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
        print_timing(args, backends, results, infos, load)
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
        data = payload(args, backends, skipped, infos, results, load, memory, memory_skipped)
        args.json.write_text(json.dumps(data, indent=1))
        log(f"wrote {args.json}")
    return 0


def print_timing(args, backends, results, infos, load) -> None:
    """The timing table with its header line and legend."""
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
    print(markdown_table(results, infos, backends, spread=args.spread, targets=targets))
    if targets is None:
        print("\n" + TARGETS_NOTE)


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


if __name__ == "__main__":
    sys.exit(main())
