"""The overhead table of the main job, measured by :mod:`experiments.overhead`."""

from __future__ import annotations

import shlex
from pathlib import Path

import torch

from curvopt import extensions as ext

from ..overhead.cases import QUANTITIES, Quantity, register_quantity
from ..overhead.cli import OVERHEAD

#: Overhead table: the network and quantities (first order from experiments.overhead, second
#: order registered here). Budgeted: Monte-Carlo curvature only (one backpropagated column).
OVERHEAD_PROBLEMS = ("3c3d",)
BUDGET_SECOND_ORDER = ("DiagGGNMC", "KFAC")
FULL_SECOND_ORDER = ("DiagGGNMC", "DiagGGNExact", "KFAC", "KFLR", "KFRA", "DiagHessian")
FIRST_ORDER = ("hooks", "BatchGrad", "BatchL2Grad", "SumGradSquared", "Variance")


def register_second_order(names) -> list[str]:
    """Add second-order quantities to experiments.overhead's registry; returns those added."""
    added = []
    for name in names:
        cls = getattr(ext, name, None)
        if cls is None:
            continue
        if name not in QUANTITIES:
            register_quantity(Quantity(name, name, (cls,), order=2))
        added.append(name)
    return added


def run_overhead(args, log) -> Path | None:
    """The overhead table of 3C3D via ``experiments.overhead``; returns its JSON path."""
    path = args.out / "overhead.json"
    second = FULL_SECOND_ORDER if args.full else BUDGET_SECOND_ORDER
    try:
        second = register_second_order(second)
    except Exception as err:  # noqa: BLE001
        log(f"second-order quantities not added to the overhead table: {err}")
        second = []
    quantities = [q for q in (*FIRST_ORDER, *second) if q in QUANTITIES]
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
    log("overhead table: python -m experiments overhead " + shlex.join(argv))
    before = torch.get_num_threads()
    try:
        code = OVERHEAD.main(argv)
    except Exception as err:  # noqa: BLE001
        log(f"overhead table failed: {type(err).__name__}: {err}")
        return None
    finally:
        torch.set_num_threads(before)
    if code != 0 or not path.exists():
        log(f"overhead table failed (exit code {code})")
        return None
    return path
