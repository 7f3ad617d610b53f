"""Overhead of first-order quantities: one benchmark per (problem, backend, quantity).

Groups are problems, so pytest-benchmark's own table compares all steps of one network; the
session summary adds each step's median ratio to the plain forward+backward, measured
interleaved (one untimed plain step before every timed round). Backends that are not installed
(Opacus, BackPACK) are skipped, as are cases a backend cannot compute.
"""

from __future__ import annotations

import pytest

from experiments.overhead.backends import BACKENDS

PROBLEMS = ("3c3d", "mlp", "cnn", "transformer")
QUANTITIES = ("hooks", "BatchGrad", "BatchL2Grad", "SumGradSquared", "Variance", "first_order")


def _cases():
    for problem in PROBLEMS:
        yield pytest.param(problem, "plain", "plain", id=f"{problem}-plain")
        for backend in BACKENDS:
            for quantity in QUANTITIES:
                yield pytest.param(problem, backend, quantity, id=f"{problem}-{backend}-{quantity}")


@pytest.mark.parametrize("problem,backend,quantity", list(_cases()))
def test_first_order(benchmark, interleaved, overhead_steps, problem, backend, quantity):
    step, plain = overhead_steps(problem, backend, quantity)
    interleaved(benchmark, (problem, backend, quantity), step, plain)
