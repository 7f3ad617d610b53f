"""``benchmarks.per_module_cost``: each quantity runs beside its plain pass, and the ``hooks``
floor is the plain pass with hooks that change nothing."""

from __future__ import annotations

import torch
from torch import nn

from benchmarks import per_module_cost


def test_the_model_is_the_overhead_benchmarks_problem_with_its_linear_modules_counted():
    model, X, y, _ = per_module_cost.build(3)
    assert X.shape == (3, 16) and y.shape == (3,)
    assert per_module_cost.MODULES == 33 == sum(isinstance(m, nn.Linear) for m in model.modules())


def test_every_quantity_is_measured_per_module():
    quantities = ("hooks", "BatchGrad", "step_every_10")
    found = per_module_cost.measure(quantities, batch=2, rounds=1, repeats=1)
    assert tuple(found) == quantities
    for r in found.values():
        assert r["curvopt_us"] > 0 and r["plain_us"] > 0
        assert r["per_module_us"] == r["overhead_us"] / 33


def test_the_idle_hooks_sit_where_extend_puts_its_own_and_change_nothing():
    model, X, y, lossfunc = per_module_cost.with_idle_hooks(4)
    lossfunc(model(X), y).backward()
    bare, X, y, lossfunc = per_module_cost.build(4)
    lossfunc(bare(X), y).backward()
    for p, q in zip(model.parameters(), bare.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert all(m._forward_hooks for m in model.modules() if isinstance(m, nn.Linear))
    assert all(p._backward_hooks for p in model.parameters())
