"""pytest-benchmark suite of curvopt's overhead and optimizer steps (not part of the unit tests).

    pytest benchmarks --benchmark-only                      # all suites, all backends found
    pytest benchmarks --benchmark-only -k "3c3d and curvopt"
    pytest benchmarks/test_bench_optim.py --benchmark-only  # optimizer steps only
    CURVOPT_BENCH_THREADS=4 CURVOPT_BENCH_ROUNDS=50 pytest benchmarks --benchmark-only

Suites: first-order quantities (``test_bench_first_order.py``), second-order quantities with
BackPACK side by side when importable (``test_bench_second_order.py``), optimizer steps
(``test_bench_optim.py``, steps of ``benchmarks/optim_steps.py``). The overhead steps and their
networks come from ``experiments.overhead``. ``torch.set_num_threads``
is fixed (default 2) and printed in the header. Each test interleaves its baseline (the plain
forward+backward; SGD with momentum for optimizers) with its own step (the baseline runs in
pytest-benchmark's untimed ``setup`` before every timed round), so the ratio printed at the end
of the session compares times measured side by side.

A stored baseline (``benchmarks/baseline/``, see README "Tests and benchmarks") makes a slowdown
visible in one command: ``--benchmark-storage=benchmarks/baseline --benchmark-compare``.
"""

from __future__ import annotations

import os
import statistics
import time

import pytest

# sleeping (not spinning) OpenMP workers: stable timings on a shared machine (see overhead.py)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from experiments.overhead.backends import BACKENDS, Instance, PlainBackend, Unsupported  # noqa: E402
from experiments.overhead.cases import PLAIN, QUANTITIES, TARGETS  # noqa: E402
from experiments.overhead.problems import PROBLEMS  # noqa: E402

from .optim_steps import GOALS  # noqa: E402

THREADS = int(os.environ.get("CURVOPT_BENCH_THREADS", "2"))
#: timed rounds per benchmark (each preceded by one untimed baseline step)
ROUNDS = int(os.environ.get("CURVOPT_BENCH_ROUNDS", "20"))
WARMUP = int(os.environ.get("CURVOPT_BENCH_WARMUP", "3"))

torch.set_num_threads(THREADS)

#: (group, backend, quantity) -> (median ratio to baseline, q1, q3, median ms), from the tests
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
    tr = terminalreporter
    tr.write_sep(
        "-",
        f"ratio to the baseline: plain forward+backward, or an SGD-momentum step for optimizers "
        f"(interleaved, threads={THREADS})",
    )
    tr.write_line("| problem | backend | quantity | ratio (q1–q3) | step ms | target |")
    tr.write_line("|---|---|---|---|---|---|")
    for (problem, backend, quantity), (ratio, q1, q3, ms) in sorted(RATIOS.items()):
        target = None
        if backend == "curvopt":
            target = TARGETS.get((problem, quantity))
        elif backend == "curvopt.optim":
            target = GOALS.get((problem, quantity))
        mark = "" if target is None else f"≤ {target:.2f} {'✓' if ratio <= target else '✗'}"
        tr.write_line(
            f"| {problem} | {backend} | {quantity} | {ratio:.2f} ({q1:.2f}–{q3:.2f}) "
            f"| {ms:.2f} | {mark} |"
        )


def _record_ratio(key, case_times, baseline_times):
    ratios = [c / p for c, p in zip(case_times, baseline_times)]
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    RATIOS[key] = (statistics.median(ratios), q1, q3, 1e3 * statistics.median(case_times))
    return statistics.median(ratios)


def _interleaved(benchmark, key, step, baseline):
    """Time ``step`` with pytest-benchmark, one untimed ``baseline`` call before every round;
    record and return the median ratio of their times. ``key = (group, backend, quantity)``;
    the group is pytest-benchmark's, so its own table compares the steps of one network."""
    for _ in range(WARMUP):  # steady state: buffers allocated, caches warm
        baseline()
        step()
    baseline_times = []

    def run_baseline():
        start = time.perf_counter()
        baseline()
        baseline_times.append(time.perf_counter() - start)

    benchmark.group = key[0]
    benchmark.pedantic(step, setup=run_baseline, rounds=ROUNDS, iterations=1, warmup_rounds=0)
    ratio = _record_ratio(key, benchmark.stats.stats.data, baseline_times)
    benchmark.extra_info.update(
        problem=key[0], backend=key[1], quantity=key[2], ratio_to_baseline=ratio
    )
    return ratio


def _overhead_steps(problem, backend, quantity):
    """``(step, plain step)`` of one ``experiments.overhead`` case; skips when a competitor is
    missing or cannot compute the case (curvopt failing is a failure)."""
    prob = PROBLEMS[problem]
    plain = PlainBackend().make_step(Instance.of(prob), QUANTITIES[PLAIN])
    if backend == "plain":
        return plain, plain
    impl = BACKENDS[backend]
    reason = impl.available()
    if reason is not None:
        pytest.skip(f"{backend}: {reason}")
    inst = Instance.of(prob)
    try:
        step = impl.make_step(inst, QUANTITIES[quantity])
        step()
        impl.verify(inst, QUANTITIES[quantity])
    except Unsupported as e:
        pytest.skip(f"{backend} cannot compute {quantity} on {problem}: {e}")
    except Exception as e:  # a competitor failing is a skip, curvopt failing a failure
        if backend == "curvopt":
            raise
        pytest.skip(f"{backend} fails on {quantity}/{problem}: {type(e).__name__}: {e}")
    return step, plain


@pytest.fixture(scope="session")
def interleaved():
    """``interleaved(benchmark, (group, backend, quantity), step, baseline) -> median ratio``."""
    return _interleaved


@pytest.fixture(scope="session")
def overhead_steps():
    """``overhead_steps(problem, backend, quantity) -> (step, plain step)``."""
    return _overhead_steps
