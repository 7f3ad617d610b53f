"""The overhead benchmark's report: the markdown table and the JSON payload.

One row per (problem, quantity), one column per backend (median ratio to the plain step of the
same round). When curvopt and BackPACK (or curvlinops) both ran, a column ``curvopt/BackPACK``
(``curvopt/curvlinops``) gives, per cell, the median over rounds of curvopt's time divided by
the other's time in the same round (< 1: curvopt is faster), and a last row their geometric
mean over the cells both computed. The peak-memory table has the same rows, in MB. With floors
(``--floors``, :mod:`.floors`), four more columns: the extra work's floor in GFLOP, MB and ms and
curvopt's measured extra time over that floor.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
from collections.abc import Sequence

import torch

from .cases import DIFFERENT_DEFINITIONS, PLAIN, QUANTITIES, TARGETS
from .floors import Calibration, Floor, extra_ms
from .memory import MemoryResult
from .memory import ratio as memory_ratio
from .problems import PROBLEMS
from .timing import Result

#: the libraries compared head to head with curvopt, by backend name: their column titles
COMPETITORS = {"backpack": "BackPACK", "curvlinops": "curvlinops"}


def head_to_head(mine: Result | None, theirs: Result | None) -> float | None:
    """Median over rounds of ``mine.times[r] / theirs.times[r]`` (None if either is missing)."""
    if mine is None or theirs is None or not mine.times or len(mine.times) != len(theirs.times):
        return None
    return statistics.median(a / b for a, b in zip(mine.times, theirs.times))


#: the legend printed below a table with targets
TARGETS_NOTE = (
    "target (curvopt): the goal the project set for curvopt's ratio in that cell when the\n"
    "quantity was optimised, at the problem's own batch size (experiments/overhead/cases.py,\n"
    "TARGETS). ✓: this run's median ratio is at or below it, ✗: above. Ratios measured on a\n"
    "busy machine, with 1 thread or with few rounds (the main job takes 7) scatter widely:\n"
    "a ✗ there says to measure again on an idle machine\n"
    "(python -m experiments overhead --problems 3c3d --rounds 25 --threads 2), not that a\n"
    "computed quantity is wrong."
)


def geometric_mean(values: Sequence[float]) -> float:
    """``exp(mean(log v))``; NaN for no values."""
    if not values:
        return math.nan
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _cell(result: Result | None, target: float | None = None, spread=False) -> str:
    if result is None:
        return ""
    if result.error is not None:
        return "n/a" if result.error.startswith("n/a") else "error"
    text = f"{result.ratio:.2f}"
    if spread:
        q1, q3 = result.quartiles()
        text += f" ({q1:.2f}–{q3:.2f})"
    if target is not None:
        text += " ✓" if result.ratio <= target else " ✗"
    return text


def _versus(backends: Sequence[str]) -> list[str]:
    """The competitors compared head to head with curvopt in a table over ``backends``."""
    if "curvopt" not in backends:
        return []
    return [b for b in COMPETITORS if b in backends]


def markdown_table(
    results: list[Result],
    infos: dict[str, dict],
    backends: Sequence[str],
    spread: bool = False,
    targets: dict | None = None,
    floors: dict[tuple[str, str], Floor] | None = None,
    calibration: Calibration | None = None,
) -> str:
    """One row per (problem, quantity), one column per backend; the plain row gives its time.

    With curvopt and a competitor (BackPACK, curvlinops) among ``backends``: a column
    ``curvopt/<competitor>`` each and a geometric mean row. ``targets`` (default ``TARGETS``,
    which hold for each problem's own batch size) mark curvopt's cells. ``floors`` (with the
    ``calibration`` that times them) add the columns of :data:`FLOOR_COLUMNS`.
    """
    targets = TARGETS if targets is None else targets
    index = {(r.problem, r.quantity, r.backend): r for r in results}
    versus = _versus(backends)
    header = ["problem", "quantity", *backends, *(f"curvopt/{COMPETITORS[b]}" for b in versus)]
    header += list(FLOOR_COLUMNS) if floors is not None else []
    header.append("target (curvopt)")
    blank_floors = [""] * len(FLOOR_COLUMNS) if floors is not None else []
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    compared: dict[str, list[float]] = {b: [] for b in versus}
    for problem in infos:
        plain = f"1.00 = {infos[problem]['plain_ms']:.2f} ms"
        cells = [plain] + [""] * (len(backends) - 1 + len(versus)) + blank_floors
        lines.append(f"| {problem} | {QUANTITIES[PLAIN].label} | " + " | ".join(cells) + " | |")
        measured = {r.quantity for r in results if r.problem == problem}
        for q, quantity in QUANTITIES.items():
            if q == PLAIN or q not in measured:
                continue
            target = targets.get((problem, q))
            cells = [
                _cell(index.get((problem, q, b)), target if b == "curvopt" else None, spread)
                for b in backends
            ]
            for b in versus:
                ratio = head_to_head(index.get((problem, q, "curvopt")), index.get((problem, q, b)))
                differs = (problem, q, b) in DIFFERENT_DEFINITIONS
                cells.append("" if ratio is None else f"{ratio:.2f}" + " ≠" * differs)
                if ratio is not None and not differs:
                    compared[b].append(ratio)
            if floors is not None:
                cells += _floor_cells(
                    floors.get((problem, q)), index.get((problem, q, "curvopt")), calibration
                )
            goal = f"≤ {target:.2f}" if target else ""
            lines.append(f"| {problem} | {quantity.label} | " + " | ".join(cells) + f" | {goal} |")
    if versus:
        means = [
            f"{geometric_mean(compared[b]):.2f} ({len(compared[b])} cells)" if compared[b] else ""
            for b in versus
        ]
        blanks = " | ".join([""] * len(backends))
        after = "".join(f" {c} |" for c in blank_floors)
        lines.append(f"| geometric mean | | {blanks} | " + " | ".join(means) + f" |{after} |")
    notes = [
        f"≠ ({problem}, {QUANTITIES[q].label}, {COMPETITORS[b]}): {why}"
        for (problem, q, b), why in DIFFERENT_DEFINITIONS.items()
        if b in versus and problem in infos and (problem, q, b) in index
    ]
    if notes:
        lines += ["", "≠: not the same quantity, so not in the geometric mean.", *notes]
    return "\n".join(lines)


#: the columns ``--floors`` adds
FLOOR_COLUMNS = ("floor GFLOP", "floor MB", "floor ms", "measured/floor")


def floor_values(floor: Floor | None, result: Result | None, calibration: Calibration) -> dict:
    """A cell's floor: GFLOP, MB, ms, and curvopt's measured extra time (ms) over it."""
    if floor is None:
        return {}
    ms = floor.ms(calibration)
    measured = extra_ms(result) if result is not None and result.error is None else None
    return {
        "floor_gflop": floor.flops / 1e9,
        "floor_mb": floor.bytes / 1e6,
        "floor_ms": ms,
        "measured_extra_ms": measured,
        "measured_over_floor": measured / ms if measured is not None and ms > 0 else None,
    }


def _floor_cells(floor, result, calibration) -> list[str]:
    v = floor_values(floor, result, calibration)
    if not v:
        return [""] * len(FLOOR_COLUMNS)
    over = v["measured_over_floor"]
    return [
        f"{v['floor_gflop']:.3g}",
        f"{v['floor_mb']:.3g}",
        f"{v['floor_ms']:.3g}",
        "" if over is None else f"{over:.3g}",
    ]


#: the legend printed below a table with floors
FLOORS_NOTE = (
    "floor: a lower bound of the extra work over the plain step, counted from the network's\n"
    "Linear/Conv2d layers (experiments/overhead/floors.py has every formula); floor ms =\n"
    "max(GFLOP / achieved sgemm GFLOP/s, MB / copy bandwidth), both measured in this process;\n"
    "measured/floor = (curvopt's step - plain step, median over rounds) / floor ms."
)


def memory_table(results: list[MemoryResult], backends: Sequence[str]) -> str:
    """Peak MB per (problem, quantity): the plain step's, each backend's (and, in brackets, its
    steady-state step's), and curvopt's peak over each competitor's (< 1: curvopt needs less)."""
    index = {(r.problem, r.quantity, r.backend): r for r in results}
    versus = _versus(backends)
    header = ["problem", "quantity", "plain", *backends]
    header += [f"curvopt/{COMPETITORS[b]}" for b in versus]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    cases = dict.fromkeys((r.problem, r.quantity) for r in results if r.quantity != PLAIN)
    for problem, q in cases:
        cells = [_mb(index.get((problem, PLAIN, PLAIN)))]
        cells += [_mb(index.get((problem, q, b))) for b in backends]
        for b in versus:
            r = memory_ratio(index.get((problem, q, "curvopt")), index.get((problem, q, b)))
            cells.append("" if r is None else f"{r:.2f}")
        lines.append(f"| {problem} | {QUANTITIES[q].label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _mb(result: MemoryResult | None) -> str:
    if result is None:
        return ""
    if result.error is not None:
        return "n/a" if result.error.startswith("n/a") else "error"
    return f"{result.peak_mb:.1f} ({result.steady_mb:.1f})"


#: the legend printed below a memory table
MEMORY_NOTE = (
    "peak memory (MB): each cell in a fresh process; the peak resident memory of two steps\n"
    "above the resident memory after building the problem and one plain forward+backward\n"
    "(results and cached buffers included), in brackets that of the second step alone (the\n"
    "steady state); the ratios compare the peaks (experiments/overhead/memory.py)."
)


def payload(
    args,
    backends,
    skipped,
    infos,
    results,
    load,
    memory=(),
    memory_skipped=None,
    floors=None,
    calibration=None,
) -> dict:
    """Everything measured, for ``--json`` (read by ``paper_figs``); with ``floors``, the
    calibration and each cell's floor (:func:`floor_values`)."""
    index = {(r.problem, r.quantity, r.backend): r for r in results}
    extra = {}
    if floors is not None:
        extra["calibration"] = {
            "gemm_gflop_per_s": calibration.flops_per_s / 1e9,
            "copy_gb_per_s": calibration.bytes_per_s / 1e9,
            "threads": calibration.threads,
        }
        extra["floors"] = [
            {
                "problem": p,
                "quantity": q,
                **floor_values(f, index.get((p, q, "curvopt")), calibration),
            }
            for (p, q), f in floors.items()
        ]
    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": args.device,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "cpu_count": os.cpu_count(),
        "load_average_at_start": load,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "backends": backends,
        "skipped_backends": skipped,
        "problems": {
            p: {
                "description": PROBLEMS[p].resized(args.batch).description
                if args.batch
                else PROBLEMS[p].description,
                "batch_size": args.batch or PROBLEMS[p].batch_size,
                **infos[p],
            }
            for p in infos
        },
        "targets": {f"{p}:{q}": t for (p, q), t in TARGETS.items()},
        "results": [
            {
                "problem": r.problem,
                "quantity": r.quantity,
                "backend": r.backend,
                "ratio_median": r.ratio if r.ratios else None,
                "ratio_q1": r.quartiles()[0] if r.ratios else None,
                "ratio_q3": r.quartiles()[1] if r.ratios else None,
                "time_median_ms": 1e3 * statistics.median(r.times) if r.times else None,
                "times_ms": [1e3 * t for t in r.times],
                "error": r.error,
                **(
                    {
                        f"versus_{b}": head_to_head(r, index.get((r.problem, r.quantity, b)))
                        for b in COMPETITORS
                    }
                    if r.backend == "curvopt"
                    else {}
                ),
            }
            for r in results
        ],
        "memory": [
            {
                "problem": m.problem,
                "quantity": m.quantity,
                "backend": m.backend,
                "peak_mb": m.peak_mb,
                "steady_mb": m.steady_mb,
                "error": m.error,
            }
            for m in memory
        ],
        "memory_skipped": memory_skipped,
        **extra,
    }
