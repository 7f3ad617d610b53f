"""Results do not depend on the memory budgets that split work into chunks of samples/columns."""

import pytest
import torch
from torch import nn

import curvopt.engine.curvature
import curvopt.engine.diagonals
import curvopt.engine.reducer
from curvopt import extensions as ext
from tests.conftest import (
    assert_close,
    extended_copy,
    ggn_reference,
    per_sample_grads_loop,
    run_second_order,
)

DT = torch.float64


def _cnn():
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.Tanh(),
        nn.Conv2d(3, 2, 2, stride=2),
        nn.Flatten(),
        nn.Linear(2 * 3 * 3, 4),
        nn.Sigmoid(),
        nn.Linear(4, 3),
    ).to(DT)


@pytest.mark.parametrize("budget", [1, 50, 10**9])
def test_second_order_budget(monkeypatch, budget, seed):
    monkeypatch.setattr(curvopt.engine.diagonals, "_GRAD_BUDGET", budget)
    monkeypatch.setattr(curvopt.engine.curvature, "_COLUMN_BUDGET", max(budget, 1))
    plain = _cnn()
    x, y = torch.randn(5, 2, 6, 6, dtype=DT), torch.randint(0, 3, (5,))
    lossfunc = nn.CrossEntropyLoss()
    _, per_sample = ggn_reference(plain, lossfunc, x, y)
    model = extended_copy(plain)
    run_second_order(
        model,
        curvopt.extend(nn.CrossEntropyLoss()),
        x,
        y,
        ext.DiagGGNExact(),
        ext.BatchDiagGGNExact(),
    )
    for name, p in model.named_parameters():
        assert_close(p.diag_ggn_exact_batch, per_sample[name], name)
        assert_close(p.diag_ggn_exact, per_sample[name].sum(0), name)


@pytest.mark.parametrize("budget", [1, 100, 1 << 21])
def test_first_order_chunks(monkeypatch, budget, seed):
    monkeypatch.setattr(curvopt.engine.reducer, "_CHUNK_ELEMENTS", budget)
    plain = _cnn()
    x, y = torch.randn(5, 2, 6, 6, dtype=DT), torch.randint(0, 3, (5,))
    lossfunc = nn.CrossEntropyLoss(reduction="sum")
    reference = per_sample_grads_loop(plain, lossfunc, x, y)
    model = extended_copy(plain)
    with curvopt.collect(ext.SumGradSquared(), ext.Variance(), ext.BatchL2Grad()):
        lossfunc(model(x), y).backward()
    for name, p in model.named_parameters():
        g = reference[name]
        assert_close(p.sum_grad_squared, (g**2).sum(0), name)
        assert_close(p.variance, (g**2).mean(0) - g.mean(0) ** 2, name)
        assert_close(p.batch_l2, (g**2).flatten(1).sum(1), name)
