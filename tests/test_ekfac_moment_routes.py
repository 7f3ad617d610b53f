"""``EKFAC``'s ``S`` by the routes that form no rotated per-sample gradient one sample at a
time: one-dimensional parameters shared over positions (a ``Linear``'s or ``Conv1D``'s bias on
a sequence, a ``LayerNorm``'s or ``GroupNorm``'s weight and bias) by one product for the batch
(``layers.eigenbasis.eigen_moment_of_vectors``), an ``Embedding``'s weight from its one-hot
tokens and gradients (``eigen_moment``), against per-sample gradients from ``torch.func``
rotated and squared one sample at a time, in float64 to 1e-12; without positions (a bias of a
``Linear`` on ``[N, I]``) the per-sample route stays."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import curvopt
import curvopt.layers.embedding
import curvopt.layers.linear
import curvopt.layers.norm
from curvopt import extensions as ext
from curvopt.core.psd import psd_eigh
from curvopt.layers.eigenbasis import eigen_moment, eigen_moment_of_vectors
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


class _Tokens(nn.Module):
    """Tokens ``[N, T]`` (0 the padding) and positions (one ``arange`` for the batch) embedded,
    a Linear: logits ``[N, T, 3]``."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(6, 4, padding_idx=0)
        self.pos = nn.Embedding(5, 4)
        self.out = nn.Linear(4, 3)

    def forward(self, idx):
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.out(torch.tanh(self.tok(idx) + self.pos(positions)))


def _images():
    """``[N, 2, 4, 4]`` through Conv2d, GroupNorm, a Linear on the flattened features."""
    return nn.Sequential(
        nn.Conv2d(2, 3, 3), nn.GroupNorm(1, 3), nn.Tanh(), nn.Flatten(), nn.Linear(12, 3)
    )


def _floats(shape):
    return lambda g: torch.randn(6, *shape, generator=g, dtype=DT)


#: name -> (model, inputs, targets per sample (None: one), {parameter: the route of its S})
MODELS = {
    "sequence": (
        _Sequence,
        _floats((5, 4)),
        5,
        {k: "vectors" for k in ("inp.bias", "norm.weight", "norm.bias", "out.bias")},
    ),
    "images": (_images, _floats((2, 4, 4)), None, {"1.weight": "vectors", "1.bias": "vectors"}),
    "tokens": (
        _Tokens,
        lambda g: torch.randint(0, 6, (6, 5), generator=g),
        5,
        {"tok.weight": "operands", "pos.weight": "operands", "out.bias": "vectors"},
    ),
}


def _problem(name, seed=0):
    build, inputs, targets, routes = MODELS[name]
    torch.manual_seed(seed)
    model = build().to(DT)
    g = torch.Generator().manual_seed(seed + 1)
    x = inputs(g)
    y = torch.randint(0, 3, (6,) if targets is None else (6, targets), generator=g)
    return model, x, y, routes


def _loss(out, y, reduction):
    return nn.functional.cross_entropy(out.reshape(-1, 3), y.reshape(-1), reduction=reduction)


def _per_sample_grads(model, x, y, reduction):
    """``{name: [N, *p.shape]}`` of the loss as computed (``"mean"``: divided by all rows)
    and the scale ``c`` of ``S`` (the divisor ``D``, or 1)."""
    params = {k: p.detach() for k, p in model.named_parameters()}
    divisor = y.numel() if reduction == "mean" else 1

    def loss_of_one(params, xn, yn):
        out = functional_call(model, params, (xn.unsqueeze(0),))
        return _loss(out, yn.unsqueeze(0), "sum") / divisor

    return vmap(grad(loss_of_one), in_dims=(None, 0, 0))(params, x, y), divisor


def _moment(grads, bases, scale):
    """``scale · Σ_n (Q_0ᵀ G_n Q_1)²``, one sample at a time."""
    total = 0
    for g in grads:
        m = bases[0].T @ g.reshape(bases[0].shape[0], -1)
        if len(bases) == 2:
            m = m @ bases[1]
        total = total + m**2
    return scale * total


def _orthogonal(size, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(size, size, generator=g, dtype=DT))[0]


def _assert_matches(S, expected):
    # (a direction in a factor's null space holds rounding: 1e-12 of the largest entry)
    assert S.shape == expected.shape
    torch.testing.assert_close(S, expected, rtol=1e-12, atol=1e-12 * float(expected.max()))


@pytest.fixture
def routed(monkeypatch):
    """``route -> [the first basis of each S it made]``, from the rules' modules."""
    seen = {"vectors": [], "operands": []}

    def vectors(grads, basis):
        seen["vectors"].append(basis)
        return eigen_moment_of_vectors(grads, basis)

    def operands(left, right, bases):
        seen["operands"].append(bases[0])
        return eigen_moment(left, right, bases)

    for module in (curvopt.layers.linear, curvopt.layers.norm):
        monkeypatch.setattr(module, "eigen_moment_of_vectors", vectors)
    monkeypatch.setattr(curvopt.layers.embedding, "eigen_moment", operands)
    return seen


def _route(routed, basis):
    return next((route for route, seen in routed.items() if any(b is basis for b in seen)), None)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", list(MODELS))
def test_supplied_bases_match_the_loop_over_samples(name, reduction, seed, routed):
    model, x, y, routes = _problem(name, seed)
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
        if p.dim() == 1 or k in routes:
            assert _route(routed, bases[p][0]) == routes.get(k), k
        _assert_matches(p.ekfac[0], _moment(grads[k], bases[p], scale))


@pytest.mark.parametrize("name", list(MODELS))
def test_fresh_bases_match_the_loop_over_samples(name, routed):
    model, x, y, routes = _problem(name)
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
    for k, _ in model.named_parameters():
        S, *bases = written["ekfac"][k]
        assert _route(routed, bases[0]) == routes.get(k), k
        for basis, factor in zip(bases, written["kfac"][k]):
            torch.testing.assert_close(basis, psd_eigh(factor)[1], rtol=0, atol=0)
        _assert_matches(S, _moment(grads[k], bases, scale))


def test_embeddings_one_sample_at_a_time_match_the_loop_over_samples(routed, monkeypatch):
    """With room for one sample's one-hot tokens (``CHUNK_ELEMENTS``), each embedding's ``S``
    is summed over one-sample chunks, and equals the loop's."""
    monkeypatch.setattr("curvopt.layers.registry.CHUNK_ELEMENTS", 1)
    model, x, y, _ = _problem("tokens")
    grads, scale = _per_sample_grads(model, x, y, "mean")
    model = curvopt.extend(model)
    bases = {
        p: [_orthogonal(p.shape[0], 1), _orthogonal(p.shape[1], 2)]
        for p in (model.tok.weight, model.pos.weight)
    }
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    with curvopt.collect(ext.EKFAC(bases=bases)):
        lossfunc(model(x).reshape(-1, 3), y.reshape(-1)).backward()
    for k in ("tok.weight", "pos.weight"):
        p = model.get_parameter(k)
        assert sum(b is bases[p][0] for b in routed["operands"]) == x.shape[0], k
        _assert_matches(p.ekfac[0], _moment(grads[k], bases[p], scale))
