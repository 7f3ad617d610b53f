"""A ResNet with ``BatchNorm2d`` in training mode trains with ``KFAC`` (Monte-Carlo, the
default), ``EKFAC`` (its bases from those factors, ``S`` from the sampled columns' batch
gradients) and ``DiagGGNNewton(curvature="mc")``, only the optimizer line changed from SGD; so
does an MLP with ``BatchNorm1d``, with ``MSELoss`` and both reductions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import curvopt
from fixtures import zoo

DT = torch.float64
STEPS = 30


def resnet():
    return zoo.resnet(width=8, blocks=1)


def mlp():
    return nn.Sequential(
        nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16), nn.BatchNorm1d(16),
        nn.ReLU(), nn.Linear(16, 3),
    )  # fmt: skip


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1),
    "kfac": lambda params: curvopt.optim.KFAC(params, lr=0.1, damping=1e-2),
    "ekfac": lambda params: curvopt.optim.EKFAC(params, lr=0.1, damping=1e-2),
    "diag": lambda params: curvopt.optim.DiagGGNNewton(
        params, lr=0.1, damping=1e-2, curvature="mc"
    ),
}


def _train(model, make, X, y, loss_fn):
    torch.manual_seed(1)
    model = curvopt.extend(model.to(DT)).train()
    opt = make(model.parameters())
    losses = []
    for step in range(STEPS):
        batch = slice(16 * (step % 4), 16 * (step % 4 + 1))  # four mini-batches of 16
        opt.zero_grad()
        loss = loss_fn(model(X[batch]), y[batch])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert model.training
    return losses


@pytest.mark.parametrize("name", ["kfac", "ekfac", "diag"])
def test_resnet_with_batchnorm_in_training_mode_trains(name):
    torch.manual_seed(0)
    X = torch.randn(64, 3, 8, 8, dtype=DT)
    y = (X.mean((2, 3)) @ torch.randn(3, 4, dtype=DT)).argmax(1)  # learnable labels
    torch.manual_seed(0)
    baseline = _train(resnet(), OPTIMIZERS["sgd"], X, y, F.cross_entropy)
    torch.manual_seed(0)
    losses = _train(resnet(), OPTIMIZERS[name], X, y, F.cross_entropy)
    assert all(map(torch.isfinite, torch.tensor(losses)))
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4  # one epoch each
    assert last < 0.6 * first, losses
    assert last < sum(baseline[-4:]) / 4, (losses, baseline)  # and beats SGD at the same lr


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", ["kfac", "ekfac", "diag"])
def test_mlp_with_batchnorm1d_regression_trains(name, reduction):
    torch.manual_seed(0)
    X = torch.randn(64, 6, dtype=DT)
    y = torch.sin(X[:, :3]) + 0.1 * torch.randn(64, 3, dtype=DT)
    lr = 0.1 if reduction == "mean" else 0.1 / 16
    make = OPTIMIZERS[name]
    torch.manual_seed(0)

    def make_lr(params):
        opt = make(params)
        for group in opt.param_groups:
            group["lr"] = lr
        return opt

    losses = _train(mlp(), make_lr, X, y, lambda o, t: F.mse_loss(o, t, reduction=reduction))
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert last < 0.6 * first, losses
