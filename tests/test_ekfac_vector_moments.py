"""``EKFAC``'s ``S`` of one-dimensional parameters shared over positions (a ``Linear``'s or
``Conv1D``'s bias on a sequence, a ``LayerNorm``'s or ``GroupNorm``'s weight and bias) by one
product for the batch (``layers.eigenbasis.eigen_moment_of_vectors``), against per-sample
gradients from ``torch.func`` rotated and squared one sample at a time, in float64 to 1e-12;
without positions (a bias of a ``Linear`` on ``[N, I]``) the per-sample route stays."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import curvopt
import curvopt.layers.linear
import curvopt.layers.norm
from curvopt import extensions as ext
from curvopt.core.psd import psd_eigh
from curvopt.layers.eigenbasis import eigen_moment_of_vectors
from conftest import Conv1D

DT = torch.float64


class _Sequence(nn.Module):
    """``[N, T, 4]`` through Linear, LayerNorm, Conv1D: logits ``[N, T, 3]``."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.norm = nn.LayerNorm(6)
        self.out = Conv1D(3, 6)

    def forward(self, x):
        return self.out(torch.tanh(self.norm(self.inp(x))))


def _images():
    """``[N, 2, 4, 4]`` through Conv2d, GroupNorm, a Linear on the flattened features."""
    return nn.Sequential(
        nn.Conv2d(2, 3, 3), nn.GroupNorm(1, 3), nn.Tanh(), nn.Flatten(), nn.Linear(12, 3)
    )


#: name -> (model, input shape, targets per sample (None: one), parameters shared over positions)
MODELS = {
    "sequence": (_Sequence, (5, 4), 5, {"inp.bias", "norm.weight", "norm.bias", "out.bias"}),
    "images": (_images, (2, 4, 4), None, {"1.weight", "1.bias"}),
}


def _problem(name, seed=0):
    build, shape, targets, shared = MODELS[name]
    torch.manual_seed(seed)
    model = build().to(DT)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(6, *shape, generator=g, dtype=DT)
    y = torch.randint(0, 3, (6,) if targets is None else (6, targets), generator=g)
    return model, x, y, shared


def _loss(out, y, reduction):
    return nn.functional.cross_entropy(out.reshape(-1, 3), y.reshape(-1), reduction=reduction)


def _per_sample_grads(model, x, y, reduction):
    """``{name: [N, *p.shape]}`` of the loss as computed (``"mean"``: divided by all rows)."""
    params = {k: p.detach() for k, p in model.named_parameters()}
    divisor = y.numel() if reduction == "mean" else 1

    def loss_of_one(params, xn, yn):
        out = functional_call(model, params, (xn.unsqueeze(0),))
        return _loss(out, yn.unsqueeze(0), "sum") / divisor

    return vmap(grad(loss_of_one), in_dims=(None, 0, 0))(params, x, y), divisor


def _moment(grads, basis, scale):
    """``scale · Σ_n (Q_0ᵀ g_n)²`` as ``[d, 1]``, one sample at a time."""
    return scale * sum((basis.T @ g.reshape(-1, 1)) ** 2 for g in grads)


def _orthogonal(size, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(size, size, generator=g, dtype=DT))[0]


@pytest.fixture
def routed(monkeypatch):
    """The parameters whose ``S`` took the one product (by the tensor of its basis)."""
    seen = []

    def spy(grads, basis):
        seen.append(basis)
        return eigen_moment_of_vectors(grads, basis)

    for module in (curvopt.layers.linear, curvopt.layers.norm):
        monkeypatch.setattr(module, "eigen_moment_of_vectors", spy)
    return seen


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", list(MODELS))
def test_shared_vectors_in_supplied_bases_match_the_loop_over_samples(
    name, reduction, seed, routed
):
    model, x, y, shared = _problem(name, seed)
    grads, scale = _per_sample_grads(model, x, y, reduction)
    model = curvopt.extend(model)
    sides = [[p.shape[0], p[0].numel()][: p.dim()] for p in model.parameters()]
    bases = {
        p: [_orthogonal(s, 10 * i + j) for j, s in enumerate(sizes)]
        for i, (p, sizes) in enumerate(zip(model.parameters(), sides))
    }
    lossfunc = curvopt.extend(nn.CrossEntropyLoss(reduction=reduction))
    with curvopt.collect(ext.EKFAC(bases=bases)):
        lossfunc(model(x).reshape(-1, 3), y.reshape(-1)).backward()
    for k, p in model.named_parameters():
        if p.dim() != 1:
            continue
        took = any(b is bases[p][0] for b in routed)
        assert took == (k in shared), k
        S = p.ekfac[0]
        assert S.shape == (p.shape[0], 1)
        torch.testing.assert_close(S, _moment(grads[k], bases[p][0], scale), rtol=1e-12, atol=0)


@pytest.mark.parametrize("name", list(MODELS))
def test_shared_vectors_in_fresh_bases_match_the_loop_over_samples(name, routed):
    model, x, y, shared = _problem(name)
    grads, scale = _per_sample_grads(model, x, y, "mean")
    model = curvopt.extend(model)
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    written = {}
    for extension in (ext.EKFAC(), ext.KFAC()):
        torch.manual_seed(3)  # the same sampled columns: the same factors
        model.zero_grad()
        with curvopt.collect(extension):
            lossfunc(model(x).reshape(-1, 3), y.reshape(-1)).backward()
        written[extension.attr] = {
            k: getattr(p, extension.attr) for k, p in model.named_parameters()
        }
    assert len(routed) == len(shared)
    for k in shared:
        S, basis = written["ekfac"][k]
        torch.testing.assert_close(basis, psd_eigh(written["kfac"][k][0])[1], rtol=0, atol=0)
        # (a direction of the factor's null space holds rounding: 1e-12 of the largest entry)
        expected = _moment(grads[k], basis, scale)
        torch.testing.assert_close(S, expected, rtol=1e-12, atol=1e-12 * float(expected.max()))
