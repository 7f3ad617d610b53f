"""``GradScaler`` with ``unscale_`` and clipping before ``step`` (``curvopt.optim.loss_scale``).

Hugging Face's Trainer, accelerate's ``clip_grad_norm_`` and Lightning's ``16-mixed`` call
``scaler.unscale_(opt)`` before ``scaler.step(opt)``: ``p.grad`` is then unscaled (and maybe
clipped), the curvature of the same pass is not. Every run below is compared with its unscaled
float64 twin (the same loop without the scaler), at a scale that changes every step.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import curvopt
from curvopt.optim import EKFAC, KFAC, DiagGGNNewton, VarianceAdaptedSGD
from curvopt.optim.loss_scale import stepping_scaler
from conftest import scaled_step

DT = torch.float64

OPTIMIZERS = {
    "KFAC": lambda ps: KFAC(ps, lr=0.1, damping=1e-2, curvature_ema=0.5, kl_clip=None),
    "EKFAC": lambda ps: EKFAC(ps, lr=0.1, damping=1e-2, basis_interval=2, kl_clip=None),
    "DiagGGNNewton": lambda ps: DiagGGNNewton(ps, lr=0.1, damping=1e-2, curvature_ema=0.5),
    "VarianceAdaptedSGD": lambda ps: VarianceAdaptedSGD(ps, lr=0.1, momentum=0.5),
}


def _problem():
    """An embedding (output-side factor second), then an MLP; integer inputs."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(7, 4), nn.Flatten(), nn.Linear(12, 5), nn.Tanh(), nn.Linear(5, 3)
    )
    model = curvopt.extend(model.to(DT))
    generator = torch.Generator().manual_seed(1)
    X = torch.randint(0, 7, (8, 3), generator=generator)
    y = torch.randint(0, 3, (8,), generator=generator)
    return model, curvopt.extend(nn.CrossEntropyLoss()), X, y


def _trained(name, scaler, unscale=False, clip=None, weight=1.0, steps=4):
    """The parameters after ``steps`` steps (and the gradient norms seen by the clipping)."""
    model, lossfunc, X, y = _problem()
    opt = OPTIMIZERS[name](model.parameters())
    norms = []
    for step in range(steps):
        opt.zero_grad()
        torch.manual_seed(10 + step)
        norm = scaled_step(
            opt, weight * lossfunc(model(X), y), scaler, unscale, clip, model.parameters()
        )
        if norm is not None:
            norms.append(norm)
    if scaler is not None:
        assert scaler.get_scale() == 16 * 2**steps  # the scale changed at every step
    return torch.cat([p.detach().flatten() for p in model.parameters()]), norms


def _scaler():
    return torch.amp.GradScaler("cpu", init_scale=16.0, growth_interval=1)


@pytest.mark.parametrize("unscale", [False, True], ids=["step", "unscale_-then-step"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_grad_scaler_gives_the_unscaled_steps(name, unscale):
    start = torch.cat([p.detach().flatten() for p in _problem()[0].parameters()])
    plain, _ = _trained(name, None)
    scaled, _ = _trained(name, _scaler(), unscale=unscale)
    assert (plain - start).norm() > 1e-3
    torch.testing.assert_close(scaled, plain, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_clipping_after_unscale_gives_the_steps_of_the_same_clipping_unscaled(name):
    plain, norms = _trained(name, None, clip=0.05)
    assert max(norms) > 0.05  # the clipping acted
    scaled, scaled_norms = _trained(name, _scaler(), unscale=True, clip=0.05)
    torch.testing.assert_close(torch.tensor(scaled_norms), torch.tensor(norms), rtol=1e-10, atol=0)
    torch.testing.assert_close(scaled, plain, rtol=1e-10, atol=1e-12)
    unclipped, _ = _trained(name, None)
    assert (unclipped - plain).norm() > 1e-6  # clipping changed the steps


@pytest.mark.parametrize("unscale", [False, True], ids=["step", "unscale_-then-step"])
@pytest.mark.parametrize("name", ["KFAC", "DiagGGNNewton"])
def test_a_users_own_loss_weight_stays_in_the_curvature(name, unscale):
    """``scaler.scale(0.5 * loss)``: the curvature is that of ``0.5 * loss``, as unscaled."""
    plain, _ = _trained(name, None, weight=0.5)
    scaled, _ = _trained(name, _scaler(), unscale=unscale, weight=0.5)
    torch.testing.assert_close(scaled, plain, rtol=1e-10, atol=1e-12)
    full, _ = _trained(name, None)
    assert (full - plain).norm() > 1e-6  # the weight matters


def test_the_stepping_scaler_is_found_only_inside_its_step():
    scaler = torch.amp.GradScaler("cpu")
    seen = []

    class Probe(torch.optim.SGD):
        _step_supports_amp_scaling = True

        def step(self, closure=None):
            seen.append(stepping_scaler())

    p = nn.Parameter(torch.ones(2))
    opt = Probe([p], lr=0.1)
    scaler.scale(p.sum()).backward()
    scaler.unscale_(opt)
    scaler.step(opt)
    opt.step()
    assert seen == [scaler, None]
    assert stepping_scaler() is None


def test_an_overflow_flag_without_a_scaler_raises():
    model, lossfunc, X, y = _problem()
    opt = OPTIMIZERS["KFAC"](model.parameters())
    with opt.collect():
        lossfunc(model(X), y).backward()
    opt.found_inf = torch.zeros(())  # as GradScaler sets it, but no scaler calls step
    with pytest.raises(RuntimeError, match="scaler.step"):
        opt.step()
