"""pytest-benchmark suite of curvopt's overhead (not part of the unit tests).

    pytest benchmarks --benchmark-only                      # all problems, all backends found
    pytest benchmarks --benchmark-only -k "3c3d and curvopt"
    CURVOPT_BENCH_THREADS=4 CURVOPT_BENCH_ROUNDS=50 pytest benchmarks --benchmark-only

The steps (what one benchmark round runs) come from ``experiments/overhead.py``, the networks
from ``benchmarks/models.py``. ``torch.set_num_threads`` is fixed (default 2) and printed in
the header. Each test interleaves the plain forward+backward with its own step (the plain step
runs in pytest-benchmark's untimed ``setup`` before every timed round), so the ratio printed at
the end of the session compares times measured side by side. For the full interleaved table,
use ``python -m experiments.overhead``.
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

import pytest

# sleeping (not spinning) OpenMP workers: stable timings on a shared machine (see overhead.py)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

THREADS = int(os.environ.get("CURVOPT_BENCH_THREADS", "2"))
#: timed rounds per benchmark (each preceded by one untimed plain step)
ROUNDS = int(os.environ.get("CURVOPT_BENCH_ROUNDS", "20"))
WARMUP = int(os.environ.get("CURVOPT_BENCH_WARMUP", "3"))

torch.set_num_threads(THREADS)

#: (group, name) -> (median ratio to plain, q1, q3, median ms), filled by the tests
RATIOS: dict = {}


def pytest_report_header(config):
    return (
        f"curvopt benchmarks: torch {torch.__version__}, "
        f"torch.set_num_threads({torch.get_num_threads()}), "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, {os.cpu_count()} CPUs, "
        f"{ROUNDS} rounds after {WARMUP} warm-up steps"
    )


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not RATIOS:
        return
    from experiments.overhead import TARGETS

    tr = terminalreporter
    tr.write_sep("-", f"ratio to plain forward+backward (interleaved, threads={THREADS})")
    tr.write_line("| problem | backend | quantity | ratio (q1–q3) | step ms | target |")
    tr.write_line("|---|---|---|---|---|---|")
    for (problem, backend, quantity), (ratio, q1, q3, ms) in sorted(RATIOS.items()):
        target = TARGETS.get((problem, quantity)) if backend == "curvopt" else None
        mark = "" if target is None else f"≤ {target:.2f} {'✓' if ratio <= target else '✗'}"
        tr.write_line(
            f"| {problem} | {backend} | {quantity} | {ratio:.2f} ({q1:.2f}–{q3:.2f}) "
            f"| {ms:.2f} | {mark} |"
        )


def _record_ratio(problem, backend, quantity, case_times, plain_times):
    ratios = [c / p for c, p in zip(case_times, plain_times)]
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    RATIOS[(problem, backend, quantity)] = (
        statistics.median(ratios),
        q1,
        q3,
        1e3 * statistics.median(case_times),
    )
    return statistics.median(ratios)


@pytest.fixture(scope="session")
def bench_config():
    """``(rounds, warmup)`` for every benchmark (env CURVOPT_BENCH_ROUNDS / _WARMUP)."""
    return ROUNDS, WARMUP


@pytest.fixture(scope="session")
def record_ratio():
    """``record_ratio(problem, backend, quantity, case_times, plain_times) -> median ratio``."""
    return _record_ratio
