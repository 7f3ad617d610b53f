"""KFAC and EKFAC with ``kfac_approx="reduce"``: each step against a dense float64 reference
built from the factors ``collect`` writes with the same option (``kron(B, A)`` damped by the
trace-norm rule and solved densely), on a convolutional net whose factors differ in scale."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import curvopt
from curvopt import extensions as ext
from curvopt.optim import EKFAC, KFAC

DT = torch.float64
LAMBDA = 0.05


def conv_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Conv2d(3, 4, 2, stride=2), nn.Flatten(), nn.Linear(36, 3)
    ).to(DT)


def batch(seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    # inputs 20x larger than the outputs' scale: the trace-norm split pi is far from 1
    return 20 * torch.randn(5, 2, 9, 9, generator=gen, dtype=DT), torch.randint(
        0, 3, (5,), generator=gen
    )


def trace_norm_reference(factors, grad: torch.Tensor, damping: float) -> torch.Tensor:
    """``(kron(B + sqrt(l)/pi I, A + pi sqrt(l) I))^-1 vec(g)`` formed and solved densely."""
    if len(factors) == 1:
        (b,) = factors
        return torch.linalg.solve(b + damping * torch.eye(len(b), dtype=DT), grad.flatten())
    b, a = factors
    pi = ((a.trace() / len(a)) / (b.trace() / len(b))).sqrt()
    root = damping**0.5
    damped = torch.kron(
        b + root / pi * torch.eye(len(b), dtype=DT), a + pi * root * torch.eye(len(a), dtype=DT)
    )
    return torch.linalg.solve(damped, grad.flatten())


def collected(model, lossfunc, extension, seed=3):
    """``(grads, quantities)`` of one pass inside ``collect(extension)`` on a copy of ``model``."""
    model = curvopt.extend(copy.deepcopy(model))
    x, y = batch()
    torch.manual_seed(seed)
    with curvopt.collect(extension):
        lossfunc(model(x), y).backward()
    attr = extension.quantity.attr
    return [p.grad.clone() for p in model.parameters()], [
        [f.clone() for f in getattr(p, attr)] for p in model.parameters()
    ]


def optimizer_step(model, lossfunc, opt, seed=3):
    x, y = batch()
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    torch.manual_seed(seed)
    lossfunc(model(x), y).backward()
    opt.step()
    return [b - p.detach() for b, p in zip(before, model.parameters())]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("curvature", ["kflr", "kfac"])
def test_kfac_reduce_step_equals_dense_reference(curvature, reduction):
    model = curvopt.extend(conv_net())
    lossfunc = curvopt.extend(nn.CrossEntropyLoss(reduction=reduction))
    make = ext.KFLR if curvature == "kflr" else ext.KFAC
    grads, factors = collected(model, lossfunc, make(kfac_approx="reduce"))
    _, expanded = collected(model, lossfunc, make(kfac_approx="expand"))
    opt = KFAC(model.parameters(), 1.0, LAMBDA, curvature, kfac_approx="reduce", kl_clip=None)
    steps = optimizer_step(model, lossfunc, opt)
    b, a = factors[0]
    pi = ((a.trace() / len(a)) / (b.trace() / len(b))).sqrt()
    assert not 1 / 3 < float(pi) < 3  # a swapped damping split would show
    # reduce and expand differ on the convolutions (so the test tells them apart)
    assert not torch.allclose(factors[0][1], expanded[0][1], rtol=1e-3)
    for step, grad, fs in zip(steps, grads, factors):
        torch.testing.assert_close(step.flatten(), trace_norm_reference(fs, grad, LAMBDA))


def test_ekfac_reduce_step_equals_dense_reference():
    model = curvopt.extend(conv_net())
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    grads, ekfac = collected(model, lossfunc, ext.EKFAC(factors="kflr", kfac_approx="reduce"))
    _, expanded = collected(model, lossfunc, ext.EKFAC(factors="kflr"))
    opt = EKFAC(model.parameters(), 1.0, LAMBDA, "kflr", kfac_approx="reduce", kl_clip=None)
    steps = optimizer_step(model, lossfunc, opt)
    assert not torch.allclose(ekfac[0][0], expanded[0][0], rtol=1e-3)
    for step, grad, (s, *bases) in zip(steps, grads, ekfac):
        q = bases[0] if len(bases) == 1 else torch.kron(*bases)
        curvature = q @ torch.diag(s.flatten()) @ q.T
        expected = torch.linalg.solve(
            curvature + LAMBDA * torch.eye(len(q), dtype=DT), grad.flatten()
        )
        torch.testing.assert_close(step.flatten(), expected)


def test_kfac_approx_is_validated_at_construction():
    params = list(conv_net().parameters())
    with pytest.raises(
        ValueError, match="kfac_approx='reduce' does not exist for curvature='kfra'"
    ):
        KFAC(params, 0.1, 0.1, "kfra", kfac_approx="reduce")
    with pytest.raises(ValueError, match="kfac_approx must be one of"):
        KFAC(params, 0.1, 0.1, kfac_approx="mean")
    with pytest.raises(ValueError, match="kfac_approx must be one of"):
        EKFAC(params, 0.1, 0.1, kfac_approx="sum")
    assert KFAC(params, 0.1, 0.1, "kfra").param_groups[0]["kfac_approx"] == "expand"
