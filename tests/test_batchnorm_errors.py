"""BatchNorm in training mode: what is not defined (per-sample quantities) or not made in a
coupled pass (``DiagHessian``, KFRA) raises a clear error naming the module, before anything is
written; the summed GGN quantities go through (``test_batchnorm_expectation`` and
``test_ekfac_coupled``: the Monte-Carlo ones' values; ``test_batchnorm_train_exact``: the exact
ones')."""

from __future__ import annotations

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
    ext.BatchDiagGGNExact,
    ext.BatchDiagGGNMC,
    ext.DiagHessian,
    ext.BatchDiagHessian,
    ext.KFRA,
    ext.KFACEmpirical,
]


@pytest.mark.parametrize("make", REFUSED, ids=lambda make: make.__name__)
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
    ``track_running_stats=False``: batch statistics in eval mode too, so coupled: per-sample
    quantities raise, the summed ones go through."""
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
        with curvopt.collect(ext.BatchDiagGGNExact()):
            loss.backward()
    loss = lossfunc(model(X), y)
    with curvopt.collect(ext.DiagGGNMC(), ext.KFAC(), ext.DiagGGNExact(), ext.KFLR()):
        loss.backward()
    assert model[1].weight.kfac[0].shape == model[1].weight.kflr[0].shape == (3, 3)


def test_optimizers_of_recursive_curvature_raise():
    """``KFAC(curvature="kfra")``: its recursion is not made in a coupled pass (the exact
    curvatures, ``"kflr"`` and ``DiagGGNNewton(curvature="exact")``, step:
    ``test_batchnorm_train_exact``)."""
    model = curvopt.extend(_model())
    X, y = _data()
    opt = curvopt.optim.KFAC(model.parameters(), lr=0.1, damping=1e-2, curvature="kfra")
    with pytest.raises(UnsupportedModuleError, match=r"'1' \(BatchNorm2d\)"):
        F.cross_entropy(model(X), y).backward()
        opt.step()
