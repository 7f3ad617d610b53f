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
from reference import per_sample_grads, per_sample_grads_replayed

DT = torch.float64
N, C, D, HEADS = 6, 3, 8, 2


class DropPath(nn.Module):
    """timm's drop path: one keep draw per sample."""

    def __init__(self, drop_prob: float):
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x):
        if self.drop_prob == 0.0 or not self.training:
            return x
        keep = 1 - self.drop_prob
        random_tensor = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
        return x * random_tensor.div_(keep)


class Block(nn.Module):
    """Pre-norm block as timm writes it: fused ``qkv``, ``F.scaled_dot_product_attention``
    with attention dropout, a GELU MLP with dropout, drop path on both branches."""

    def __init__(self, drop_path: float, drop: float):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.drop_path, self.drop = DropPath(drop_path), nn.Dropout(drop)
        self.attn_drop = drop

    def forward(self, x):
        n, t, _ = x.shape
        qkv = self.qkv(self.norm1(x)).reshape(n, t, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        p = self.attn_drop if self.training else 0.0
        h = F.scaled_dot_product_attention(q, k, v, dropout_p=p).transpose(1, 2).reshape(n, t, D)
        x = x + self.drop_path(self.proj(h))
        return x + self.drop_path(self.fc2(self.drop(F.gelu(self.fc1(self.norm2(x))))))


class ViT(nn.Module):
    """timm's layout: patch embedding, ``cls_token`` expanded and concatenated, ``pos_embed``
    added, ``register_tokens`` after the class token (``registers`` of them), position
    dropout, blocks, the class token's head."""

    def __init__(self, registers=0, drop_path=0.2, drop=0.1, depth=2):
        super().__init__()
        self.patch_embed = nn.Conv2d(2, D, 2, 2)
        self.cls_token = nn.Parameter(0.5 * torch.randn(1, 1, D))
        self.pos_embed = nn.Parameter(0.5 * torch.randn(1, 5, D))
        self.register_tokens = nn.Parameter(0.5 * torch.randn(1, registers, D)) if registers else None
        self.pos_drop = nn.Dropout(drop)
        self.blocks = nn.Sequential(
            *[Block(drop_path * (i + 1) / depth, drop) for i in range(depth)]
        )
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, C)

    def forward(self, images):
        x = self.patch_embed(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], 1) + self.pos_embed
        if self.register_tokens is not None:
            tokens = self.register_tokens.expand(x.shape[0], -1, -1)
            x = torch.cat([x[:, :1], tokens, x[:, 1:]], 1)
        x = self.blocks(self.pos_drop(x))
        return self.head(self.norm(x)[:, 0])


RAW = ("cls_token", "pos_embed", "register_tokens")


def _data(n=N, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2, 4, 4, generator=g, dtype=DT), torch.randint(0, C, (n,), generator=g)


def _plain(training: bool, registers: int, **kwargs) -> nn.Module:
    torch.manual_seed(0)
    return ViT(registers, **kwargs).to(DT).train(training)


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
        result[name] = torch.einsum("ncp,ncd,ndp->np", flat, hessians, flat).view(j.shape[0], *j.shape[2:])
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
            torch.testing.assert_close(p.diag_ggn_exact_batch, diagonals[name], rtol=1e-9, atol=1e-13)
            torch.testing.assert_close(p.diag_ggn_exact, diagonals[name].sum(0), rtol=1e-9, atol=1e-13)
    raw = [name for name, _ in model.named_parameters() if name in RAW]
    assert len(raw) == 2 + bool(registers)


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
        self.vit = ViT(0, drop_path=0.0, drop=0.0)
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
        assert reruns and set(reruns) == {"Stacked"}  # ``shift`` alone; never ``ViT``
        grads = per_sample_grads(plain, lambda out, t: F.cross_entropy(out, t), x, y)
        diagonals = _dense_ggn_diagonals(plain, x, y, state)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad_batch, grads[name], rtol=1e-9, atol=1e-12)
            torch.testing.assert_close(p.diag_ggn_exact_batch, diagonals[name], rtol=1e-9, atol=1e-13)


OPTIMIZERS = {
    "kfac": lambda params: KFAC(params, lr=0.1, damping=1e-3),
    "ekfac": lambda params: EKFAC(params, lr=0.1, damping=1e-3),
    "diag_ggn_newton": lambda params: DiagGGNNewton(params, lr=0.1, damping=1e-3),
}


def _train(make, seed: int, steps: int = 30):
    """Losses of ``steps`` steps on one fixed batch of a ViT with drop path and dropout (the
    top module's forward runs once a step: nothing re-runs it)."""
    torch.manual_seed(seed)
    model, lossfunc = ViT(2, drop_path=0.2, drop=0.1).to(DT).train(), nn.CrossEntropyLoss()
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
