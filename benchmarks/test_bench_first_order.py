"""Overhead of first-order quantities: one benchmark per (problem, backend, quantity).

Groups are problems, so pytest-benchmark's own table compares all steps of one network; the
session summary adds each step's median ratio to the plain forward+backward, measured
interleaved (one untimed plain step before every timed round). Backends that are not installed
(Opacus, BackPACK) are skipped, as are cases a backend cannot compute.
"""

from __future__ import annotations

import time

import pytest

from experiments import overhead as ov

QUANTITIES = [
    "plain",
    "hooks",
    "BatchGrad",
    "BatchL2Grad",
    "SumGradSquared",
    "Variance",
    "first_order",
]
BACKENDS = list(ov.BACKENDS)


def _cases():
    for problem in ov.PROBLEMS:
        yield pytest.param(problem, "plain", "plain", id=f"{problem}-plain")
        for backend in BACKENDS:
            for quantity in QUANTITIES[1:]:
                yield pytest.param(problem, backend, quantity, id=f"{problem}-{backend}-{quantity}")


@pytest.mark.parametrize("problem,backend,quantity", list(_cases()))
def test_first_order(benchmark, bench_config, record_ratio, problem, backend, quantity):
    rounds, warmup = bench_config
    prob = ov.PROBLEMS[problem]
    plain = ov.PlainBackend().make_step(ov.Instance.of(prob), ov.QUANTITIES["plain"])
    if backend == "plain":
        step = plain
    else:
        impl = ov.BACKENDS[backend]
        reason = impl.available()
        if reason is not None:
            pytest.skip(f"{backend}: {reason}")
        inst = ov.Instance.of(prob)
        try:
            step = impl.make_step(inst, ov.QUANTITIES[quantity])
            step()
            impl.verify(inst, ov.QUANTITIES[quantity])
        except ov.Unsupported as e:
            pytest.skip(f"{backend} cannot compute {quantity} on {problem}: {e}")
        except Exception as e:  # a competitor failing is a skip, curvopt failing a failure
            if backend == "curvopt":
                raise
            pytest.skip(f"{backend} fails on {quantity}/{problem}: {type(e).__name__}: {e}")
    for _ in range(warmup):  # steady state: buffers allocated, caches warm
        plain()
        step()

    plain_times = []

    def run_plain():
        start = time.perf_counter()
        plain()
        plain_times.append(time.perf_counter() - start)

    benchmark.group = problem
    benchmark.pedantic(step, setup=run_plain, rounds=rounds, iterations=1, warmup_rounds=0)
    ratio = record_ratio(problem, backend, quantity, benchmark.stats.stats.data, plain_times)
    benchmark.extra_info.update(
        problem=problem, backend=backend, quantity=quantity, ratio_to_plain=ratio
    )
