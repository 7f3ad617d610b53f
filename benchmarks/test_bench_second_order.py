"""Overhead of second-order quantities, curvopt and BackPACK side by side (BackPACK skipped
when not importable): one benchmark per (problem, backend, quantity), interleaved with the
plain forward+backward as in ``test_bench_first_order.py``.

The cases are issue 11's comparison (``experiments.overhead.cases.BACKPACK_CASES``: DeepOBS logreg,
2C2D, 3C3D at N=64; KFRA on logreg only) plus KFRA on the MLP; the full interleaved table with the
``curvopt/BackPACK`` column is ``python -m experiments overhead --cases backpack``.
"""

from __future__ import annotations

import pytest

from experiments.overhead.cases import BACKPACK_CASES, QUANTITIES

CASES = [(p, q) for p, q in BACKPACK_CASES if QUANTITIES[q].order == 2] + [("mlp", "KFRA")]


def _cases():
    for problem in dict.fromkeys(p for p, _ in CASES):
        yield pytest.param(problem, "plain", "plain", id=f"{problem}-plain")
    for problem, quantity in CASES:
        for backend in ("curvopt", "backpack"):
            yield pytest.param(problem, backend, quantity, id=f"{problem}-{backend}-{quantity}")


@pytest.mark.parametrize("problem,backend,quantity", list(_cases()))
def test_second_order(benchmark, interleaved, overhead_steps, problem, backend, quantity):
    step, plain = overhead_steps(problem, backend, quantity)
    interleaved(benchmark, (problem, backend, quantity), step, plain)
