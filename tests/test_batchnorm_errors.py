"""BatchNorm in training mode: what is not defined (per-sample quantities) or would cost ``N²``
propagations (exact curvature) raises a clear error naming the module, before anything is
written; the Monte-Carlo quantities go through (``test_batchnorm_expectation``: their values;
``test_ekfac_coupled``: EKFAC's, whose bases from exact factors raise)."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import curvopt
from curvopt import extensions as ext
from curvopt.errors import UnsupportedModuleError

DT = torch.float64


def _model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(),
        nn.Flatten(), nn.Linear(3 * 4 * 4, 3),
    ).to(DT)  # fmt: skip


def _data():
    return torch.randn(5, 2, 4, 4, dtype=DT), torch.randint(0, 3, (5,))


REFUSED = [
    ext.BatchGrad,
    ext.BatchL2Grad,
    ext.SumGradSquared,
    ext.Variance,
    ext.DiagGGNExact,
    ext.BatchDiagGGNExact,
    ext.BatchDiagGGNMC,
    ext.DiagHessian,
    ext.BatchDiagHessian,
    ext.KFLR,
    ext.KFRA,
    ext.KFACEmpirical,
    partial(ext.EKFAC, factors="kflr"),  # bases from exact factors
]


def _name(make) -> str:
    return getattr(make, "__name__", None) or f"{make.func.__name__}-{make.keywords['factors']}"


@pytest.mark.parametrize("make", REFUSED, ids=_name)
def test_exact_and_per_sample_quantities_raise_naming_the_module(make):
    model = curvopt.extend(_model())
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    X, y = _data()
    loss = lossfunc(model(X), y)
    extension = make()
    with pytest.raises(UnsupportedModuleError) as info:
        with curvopt.collect(extension, ext.DiagGGNMC()):
            loss.backward()
    message = str(info.value)
    assert "'1' (BatchNorm2d)" in message and "statistics of the whole batch" in message
    assert "model.eval()" in message and "Monte-Carlo" in message
    for p in model.parameters():  # nothing half-written, not even the Monte-Carlo diagonal
        assert not hasattr(p, "diag_ggn_mc") and not hasattr(p, extension.quantity.attr)


@pytest.mark.parametrize("build", ["eval", "no_running_stats"])
def test_running_statistics_stay_exact_and_batch_statistics_are_coupled(build):
    """Eval mode (running statistics): samples independent, exact quantities as before.
    ``track_running_stats=False``: batch statistics in eval mode too, so coupled."""
    model = _model()
    if build == "no_running_stats":
        model[1] = nn.BatchNorm2d(3, track_running_stats=False).to(DT)
    model = curvopt.extend(model).eval()
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    X, y = _data()
    loss = lossfunc(model(X), y)
    if build == "eval":
        with curvopt.collect(ext.BatchGrad(), ext.DiagGGNExact()):
            loss.backward()
        assert model[1].weight.grad_batch.shape == (5, 3)
        return
    with pytest.raises(UnsupportedModuleError, match="statistics of the whole batch"):
        with curvopt.collect(ext.DiagGGNExact()):
            loss.backward()
    loss = lossfunc(model(X), y)
    with curvopt.collect(ext.DiagGGNMC(), ext.KFAC()):
        loss.backward()
    assert model[1].weight.kfac[0].shape == (3, 3)


@pytest.mark.parametrize("name", ["EKFAC-kflr", "DiagGGNNewton-exact", "KFAC-kflr"])
def test_optimizers_of_exact_curvature_raise(name):
    model = curvopt.extend(_model())
    X, y = _data()
    if name == "EKFAC-kflr":
        opt = curvopt.optim.EKFAC(model.parameters(), lr=0.1, damping=1e-2, curvature="kflr")
    elif name == "KFAC-kflr":
        opt = curvopt.optim.KFAC(model.parameters(), lr=0.1, damping=1e-2, curvature="kflr")
    else:
        opt = curvopt.optim.DiagGGNNewton(
            model.parameters(), lr=0.1, damping=1e-2, curvature="exact"
        )
    with pytest.raises(UnsupportedModuleError, match=r"'1' \(BatchNorm2d\)"):
        F.cross_entropy(model(X), y).backward()
        opt.step()
