"""Curvature optimizers on ``torch.compile``d models (issue 61; docs/conventions.md, "Compiled
models"): the user's compiled model, extended, trains with ``KFAC``, ``EKFAC`` and
``DiagGGNNewton`` at their defaults (the optimizer line changed), step for step as the eager
model does (float64, exactly): ``curvopt.extend(torch.compile(model))`` runs the original
module eagerly while a second-order collection is armed for its parameters, and its compiled
graph otherwise. ``unextend`` gives the compiled forward back.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import curvopt
from curvopt import extensions as ext

DT = torch.float64
STEPS = 8


def mlp():
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def cnn():
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(4, 6, 3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(6 * 2 * 2, 3),
    )


MODELS = {"mlp": (mlp, (6,)), "cnn": (cnn, (1, 8, 8))}
OPTIMIZERS = {
    "KFAC": lambda params: curvopt.optim.KFAC(params, lr=0.1),
    "EKFAC": lambda params: curvopt.optim.EKFAC(params, lr=0.1),
    "DiagGGNNewton": lambda params: curvopt.optim.DiagGGNNewton(params, lr=0.1),
}


def _data(shape):
    g = torch.Generator().manual_seed(0)
    return torch.randn(16, *shape, generator=g, dtype=DT), torch.randint(0, 3, (16,), generator=g)


def _train(model, optimizer, X, y):
    """The user's loop; ``model`` may be compiled. Returns the losses."""
    opt = OPTIMIZERS[optimizer](model.parameters())
    losses = []
    for _ in range(STEPS):
        torch.manual_seed(1)  # the Monte-Carlo draws of the step, alike in both runs
        opt.zero_grad()
        loss = F.cross_entropy(model(X), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("name", MODELS)
def test_compiled_model_trains_as_the_eager_one(name, optimizer):
    build, shape = MODELS[name]
    torch.manual_seed(0)
    plain = build().to(DT)
    X, y = _data(shape)
    eager = curvopt.extend(copy.deepcopy(plain))
    want = _train(eager, optimizer, X, y)
    compiled = curvopt.extend(torch.compile(copy.deepcopy(plain)))  # the user's two lines
    got = _train(compiled, optimizer, X, y)
    assert all(math.isfinite(v) for v in got), got
    assert got[-1] < 0.9 * got[0], got
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-12, atol=0)
    for p, q in zip(compiled.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-15)


def test_compiled_forward_runs_where_no_curvature_is_wanted_and_comes_back_on_unextend():
    torch.manual_seed(0)
    compiled = torch.compile(mlp().to(DT), backend="aot_eager")
    original = compiled.forward
    curvopt.extend(compiled)
    curvopt.extend(compiled)  # idempotent: one switch
    assert compiled.forward.compiled is original
    X, y = _data((6,))
    torch._dynamo.reset()
    calls = torch._dynamo.utils.counters["stats"]
    before = calls["calls_captured"]
    with curvopt.collect(ext.BatchGrad()):  # first order: the compiled graph
        F.cross_entropy(compiled(X), y).backward()
    assert calls["calls_captured"] > before
    first = {n: p.grad_batch.clone() for n, p in compiled.named_parameters()}
    captured = calls["calls_captured"]
    compiled.zero_grad()
    with curvopt.collect(ext.BatchGrad(), ext.DiagGGNExact()):  # curvature: eagerly
        F.cross_entropy(compiled(X), y).backward()
    assert calls["calls_captured"] == captured
    for n, p in compiled.named_parameters():
        torch.testing.assert_close(p.grad_batch, first[n], rtol=1e-12, atol=1e-15)
        assert p.diag_ggn_exact.shape == p.shape
    curvopt.unextend(compiled)
    assert compiled.forward is original
