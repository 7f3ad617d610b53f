"""Raw parameters of the top module read where they meet the batch, not by a re-run, float64.

A timm-style ViT owns its ``cls_token``, ``pos_embed`` and ``register_tokens`` itself, so they
have no rule but the generic one, which re-runs the whole model sample by sample. A curvature
pass reads them at the expand or add where they meet the batch (``engine.parameter_sites``,
``layers.parameter``): per-sample gradients (against ``torch.func`` in eval mode, against an
eager loop replaying the forward's random numbers in training mode, with drop path, dropout
and attention dropout) and the exact GGN diagonal (against the dense ``Jᵀ H J`` of the
forward's function, draws included) per sample and summed, with the top module's forward
counted: it runs once per pass, never again per sample. A parameter expanded along a dim of
the batch's size that is not the batch fails the probes and takes the generic rule, right as
ever. ``KFAC``, ``EKFAC`` and ``DiagGGNNewton`` train the ViT with drop path and dropout.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, jacrev

import curvopt
from curvopt import extensions as ext
from curvopt.layers.generic import GenericRule
from curvopt.optim import EKFAC, KFAC, DiagGGNNewton
from fixtures.timm_like import VisionTransformer
from reference import per_sample_grads, per_sample_grads_replayed

DT = torch.float64
N, C = 6, 3


RAW = ("cls_token", "pos_embed", "register_tokens")


def _data(n=N, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2, 4, 4, generator=g, dtype=DT), torch.randint(0, C, (n,), generator=g)


def _vit(registers: int, drop_path_rate=0.2, drop_rate=0.1) -> nn.Module:
    """``images [N, 2, 4, 4]``: 4 patches and the class token (and ``registers``), width 8."""
    return VisionTransformer(
        registers=registers, drop_path_rate=drop_path_rate, drop_rate=drop_rate
    ).to(DT)


def _plain(training: bool, registers: int) -> nn.Module:
    torch.manual_seed(0)
    return _vit(registers).train(training)


def _counted(model, monkeypatch):
    """``(forwards of the top module, generic re-runs)``, counted."""
    forwards, reruns = [], []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    original = GenericRule._vmapped

    def counting(self, call, *args, **kwargs):
        reruns.append(type(call.module).__name__)
        return original(self, call, *args, **kwargs)

    monkeypatch.setattr(GenericRule, "_vmapped", counting)
    return forwards, reruns


def _dense_ggn_diagonals(plain, x, y, state):
    """``name -> [N, *p.shape]``: ``diag(J_nᵀ H_n J_n)`` of each sample's term of the mean
    cross-entropy, ``J_n`` the Jacobian of its logits (the forward from ``state``: the draws of
    the recorded forward), ``H_n = (diag(s) - s sᵀ) / N``."""
    params = {k: p.detach() for k, p in plain.named_parameters()}

    def logits(params):
        torch.set_rng_state(state)
        return functional_call(plain, params, (x,))

    with torch.random.fork_rng(devices=[]):
        jac = jacrev(logits)(params)  # name -> [N, C, *p.shape]
        out = logits(params).detach()
    s = out.softmax(-1)
    hessians = (torch.diag_embed(s) - s[:, :, None] * s[:, None, :]) / len(x)
    result = {}
    for name, j in jac.items():
        flat = j.flatten(2)  # [N, C, P]
        result[name] = torch.einsum("ncp,ncd,ndp->np", flat, hessians, flat).view(
            j.shape[0], *j.shape[2:]
        )
    return result


@pytest.mark.parametrize("registers", [0, 2])
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_per_sample_gradients_and_ggn_diagonals_at_the_sites(training, registers, monkeypatch):
    plain = _plain(training, registers)
    x, y = _data()
    model = curvopt.extend(copy.deepcopy(plain))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    forwards, reruns = _counted(model, monkeypatch)
    for _ in range(2):  # the structure's first pass (probes) and a later one
        forwards.clear()
        state = torch.get_rng_state()
        loss = lossfunc(model(x), y)
        with curvopt.collect(ext.BatchGrad(), ext.DiagGGNExact(), ext.BatchDiagGGNExact()):
            loss.backward()
        assert forwards == [1] and reruns == []
        if training:
            grads = per_sample_grads_replayed(
                plain, lambda net: F.cross_entropy(net(x), y, reduction="none") / N, state
            )
        else:
            grads = per_sample_grads(plain, lambda out, t: F.cross_entropy(out, t), x, y)
        diagonals = _dense_ggn_diagonals(plain, x, y, state)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad_batch, grads[name], rtol=1e-9, atol=1e-12)
            torch.testing.assert_close(
                p.diag_ggn_exact_batch, diagonals[name], rtol=1e-9, atol=1e-13
            )
            torch.testing.assert_close(
                p.diag_ggn_exact, diagonals[name].sum(0), rtol=1e-9, atol=1e-13
            )
    raw = [name for name, _ in model.named_parameters() if name in RAW]
    assert len(raw) == 2 + bool(registers)


@pytest.mark.filterwarnings("ignore:.*no Kronecker factorisation")
def test_the_kronecker_fallback_diagonal_at_the_sites_is_the_ggn_diagonal(monkeypatch):
    """``KFLR`` with ``skip_unsupported="diagonal"`` (the Kronecker optimizers' fallback): the
    raw tokens get the exact GGN diagonal of the forward's function, drop path included."""
    plain = _plain(True, 2)
    x, y = _data()
    model = curvopt.extend(copy.deepcopy(plain))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    forwards, reruns = _counted(model, monkeypatch)
    state = torch.get_rng_state()
    loss = lossfunc(model(x), y)
    with curvopt.collect(ext.KFLR(), skip_unsupported="diagonal") as ctx:
        loss.backward()
    assert set(ctx.skipped) == set(RAW) and forwards == [1] and reruns == []
    diagonals = _dense_ggn_diagonals(plain, x, y, state)
    for name in RAW:
        p = getattr(model, name)
        torch.testing.assert_close(p.kflr_diagonal, diagonals[name].sum(0), rtol=1e-9, atol=1e-13)


def test_the_draws_matter():
    """The training-mode check above is not vacuous: the raw parameters' per-sample gradients
    depend on the forward's draws (another generator state gives others)."""
    plain = _plain(True, 2)
    x, y = _data()

    def grads(seed):
        torch.manual_seed(seed)
        state = torch.get_rng_state()
        return per_sample_grads_replayed(
            plain, lambda net: F.cross_entropy(net(x), y, reduction="none") / N, state
        )

    first, second = grads(0), grads(1)
    for name in RAW:
        assert not torch.allclose(first[name], second[name])


class Stacked(nn.Module):
    """A raw ``shift [1, D]`` expanded along a dim of size ``N`` that is not the batch and
    summed over it: shaped like a site, it reaches every sample; the probes reject it and the
    generic rule re-runs the module for it (the class and position tokens still at their
    sites)."""

    def __init__(self):
        super().__init__()
        self.vit = _vit(0, 0.0, 0.0)
        self.shift = nn.Parameter(torch.randn(1, C))

    def forward(self, images):
        return self.vit(images) + self.shift.expand(N, C).sum(0)


def test_a_site_that_is_not_the_batch_takes_the_generic_rule(monkeypatch):
    torch.manual_seed(0)
    plain = Stacked().to(DT)
    x, y = _data()
    model = curvopt.extend(copy.deepcopy(plain))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    forwards, reruns = _counted(model.vit, monkeypatch)
    state = torch.get_rng_state()
    for _ in range(2):
        reruns.clear()
        with curvopt.collect(ext.BatchGrad(), ext.DiagGGNExact(), ext.BatchDiagGGNExact()):
            lossfunc(model(x), y).backward()
        assert reruns and set(reruns) == {"Stacked"}  # ``shift`` alone; never ``VisionTransformer``
        grads = per_sample_grads(plain, lambda out, t: F.cross_entropy(out, t), x, y)
        diagonals = _dense_ggn_diagonals(plain, x, y, state)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad_batch, grads[name], rtol=1e-9, atol=1e-12)
            torch.testing.assert_close(
                p.diag_ggn_exact_batch, diagonals[name], rtol=1e-9, atol=1e-13
            )


OPTIMIZERS = {
    "kfac": lambda params: KFAC(params, lr=0.1, damping=1e-3),
    "ekfac": lambda params: EKFAC(params, lr=0.1, damping=1e-3),
    "diag_ggn_newton": lambda params: DiagGGNNewton(params, lr=0.1, damping=1e-3),
}


def _train(make, seed: int, steps: int = 30):
    """Losses of ``steps`` steps on one fixed batch of a ViT with drop path and dropout (the
    top module's forward runs once a step: nothing re-runs it)."""
    torch.manual_seed(seed)
    model, lossfunc = _vit(2).train(), nn.CrossEntropyLoss()
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    x, y = _data(16, seed)
    if make is None:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        model, lossfunc = curvopt.extend(model), curvopt.extend(lossfunc)
        opt = make(model.parameters())
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        if make is None:
            loss = lossfunc(model(x), y)
            loss.backward()
        else:
            with opt.collect():
                loss = lossfunc(model(x), y)
                loss.backward()
        opt.step()
        losses.append(loss.item())
    assert len(forwards) == steps
    return losses


@pytest.mark.filterwarnings("ignore:.*no Kronecker factorisation")
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_curvature_optimizers_train_a_vit_with_drop_path(name):
    for seed in (0, 1):
        adamw = _train(None, seed)
        losses = _train(OPTIMIZERS[name], seed)
        assert all(math.isfinite(v) for v in losses)
        progress = losses[0] - min(losses[-5:])
        assert progress >= 0.5 * (adamw[0] - min(adamw[-5:])), (losses, adamw)
