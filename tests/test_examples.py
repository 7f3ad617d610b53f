"""The per-sample use-case examples: their core functions against loops over samples (float64)."""

from __future__ import annotations

import copy
import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import curvopt
from curvopt import extensions as ext

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name: str):
    mod_name = f"_example_{name}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = mod
    spec.loader.exec_module(mod)
    return mod


def _net(seed=0, n_in=6, conv=False):
    torch.manual_seed(seed)
    if conv:
        layers = [
            nn.Unflatten(1, (1, 2, 3)),
            nn.Conv2d(1, 3, 2, padding=1),
            nn.Tanh(),
            nn.Flatten(),
            nn.Linear(3 * 3 * 4, 4),
        ]
    else:
        layers = [nn.Linear(n_in, 5), nn.Tanh(), nn.Linear(5, 4)]
    return nn.Sequential(*layers).double()


def _data(n=7, n_in=6, seed=1):
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(n, n_in, generator=gen, dtype=torch.float64)
    return X, torch.randint(0, 4, (n,), generator=gen)


def _sample_grads(model, X, y):
    """Per-sample gradients of each sample's own cross-entropy, by a loop (reference)."""
    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for x, t in zip(X, y):
        loss = nn.functional.cross_entropy(model(x[None]), t[None])
        out.append(torch.autograd.grad(loss, params))
    return out


# --- DP-SGD -----------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("conv", [False, True])
def test_dp_clipped_norms_at_most_c_and_update_equals_loop(reduction, conv):
    dp = _load("dp_sgd_clipping")
    X, y = _data()
    model = curvopt.extend(_net(conv=conv))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss(reduction=reduction))
    params, grads, norms = dp.per_sample_gradients(model, lossfunc, X, y)
    ref = _sample_grads(model, X, y)
    ref_norms = torch.stack([torch.sqrt(sum((g**2).sum() for g in gs)) for gs in ref])
    torch.testing.assert_close(norms, ref_norms)
    s = ref_norms.sort().values
    clip, sigma = float(s[3] + s[4]) / 2, 0.7  # some samples are clipped, some not
    factor = dp.clip_factors(norms, clip)
    clipped_norms = torch.sqrt(
        sum(((g * factor.view(-1, *[1] * (g.dim() - 1))) ** 2).flatten(1).sum(1) for g in grads)
    )
    assert (clipped_norms <= clip * (1 + 1e-9)).all()
    assert (norms > clip).any() and (norms < clip).any()  # both cases occur

    info = dp.dp_gradient(model, lossfunc, X, y, clip, sigma, torch.Generator().manual_seed(5))
    gen = torch.Generator().manual_seed(5)
    for k, p in enumerate(params):
        expected = sum(
            gs[k] * min(1.0, clip / (float(ref_norms[n]) + 1e-6)) for n, gs in enumerate(ref)
        )
        expected = expected + sigma * clip * torch.randn(
            p.shape, generator=gen, dtype=torch.float64
        )
        torch.testing.assert_close(p.grad, expected / len(X))
    assert info["clipped"] == pytest.approx(float((ref_norms > clip).double().mean()))


def test_dp_without_clipping_or_noise_is_the_plain_gradient():
    dp = _load("dp_sgd_clipping")
    X, y = _data()
    model = curvopt.extend(_net())
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    plain = copy.deepcopy(model)
    nn.CrossEntropyLoss()(plain(X), y).backward()
    dp.dp_gradient(model, lossfunc, X, y, clip_norm=1e6, noise_multiplier=0.0)
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    with pytest.raises(ValueError):
        dp.dp_gradient(model, lossfunc, X, y, clip_norm=0.0, noise_multiplier=1.0)


def test_dp_short_training_runs():
    dp = _load("dp_sgd_clipping")
    gen = torch.Generator().manual_seed(0)
    X = torch.rand(96, 64, generator=gen)
    y = (X[:, :32].sum(1) > X[:, 32:].sum(1)).long()
    data = (X[:64], y[:64], X[64:], y[64:])
    r = dp.train(data, "dp", epochs=1, batch_size=32, lr=0.5, clip=1.0, sigma=1.0)
    assert 0 <= r["test_acc"] <= 1 and 0 <= r["clipped"] <= 1 and math.isfinite(r["median_norm"])


# --- TracIn -----------------------------------------------------------------------------------


def test_gradient_similarity_and_tracin_equal_loops():
    attr = _load("gradient_attribution")
    X, y = _data(n=9)
    Xt, yt = _data(n=2, seed=3)
    m1 = curvopt.extend(_net(seed=0))
    m2 = curvopt.extend(_net(seed=1))
    influence, self_inf = attr.tracin([(m1, 0.5), (m2, 0.25)], X, y, Xt, yt, batch_size=4)
    ref_inf = torch.zeros(2, 9, dtype=torch.float64)
    ref_self = torch.zeros(9, dtype=torch.float64)
    for model, lr in ((m1, 0.5), (m2, 0.25)):
        train = _sample_grads(model, X, y)
        test = _sample_grads(model, Xt, yt)
        for i, gt in enumerate(test):
            for n, gn in enumerate(train):
                ref_inf[i, n] += lr * sum((a * b).sum() for a, b in zip(gt, gn))
        for n, gn in enumerate(train):
            ref_self[n] += lr * sum((g**2).sum() for g in gn)
    torch.testing.assert_close(influence.double(), ref_inf, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(self_inf.double(), ref_self, rtol=1e-5, atol=1e-6)
    # the model's gradients are left clean
    assert all(p.grad is None for p in m1.parameters())


def test_tracin_finds_flipped_labels_on_a_toy_problem():
    attr = _load("gradient_attribution")
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(80, 6, generator=gen)
    y = (X[:, 0] > 0).long()
    flipped = torch.arange(4)
    y[flipped] = 1 - y[flipped]
    model, ckpts = attr.train_with_checkpoints(X, y, epochs=3, lr=0.5, batch_size=16, seed=0)
    _, self_inf = attr.tracin(ckpts, X, y, X[:1], y[:1])
    top = set(self_inf.argsort(descending=True)[:8].tolist())
    assert len(top & set(flipped.tolist())) >= 3


# --- gradient noise scale ---------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_noise_scale_terms_equal_loop(reduction):
    gns = _load("gradient_noise_scale")
    X, y = _data(n=8)
    model = curvopt.extend(_net(conv=True))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss(reduction=reduction))
    loss = lossfunc(model(X), y)
    with curvopt.collect(ext.Variance(), ext.SumGradSquared()):
        loss.backward()
    a = gns.noise_scale_terms(model, len(X), reduction)
    b = gns.noise_scale_terms_sgs(model, len(X), reduction)
    g = torch.stack([torch.cat([t.flatten() for t in gs]) for gs in _sample_grads(model, X, y)])
    n = len(X)
    mean = g.mean(0)
    tr_sigma = ((g - mean) ** 2).sum() / (n - 1)
    grad_sq = (mean**2).sum() - tr_sigma / n
    for terms in (a, b):
        assert terms["tr_sigma"] == pytest.approx(float(tr_sigma), rel=1e-9)
        assert terms["batch_grad_sq"] == pytest.approx(float((mean**2).sum()), rel=1e-9)
        assert terms["grad_sq"] == pytest.approx(float(grad_sq), rel=1e-7, abs=1e-12)
        if grad_sq > 0:
            assert terms["b_simple"] == pytest.approx(float(tr_sigma / grad_sq), rel=1e-6)
    with pytest.raises(ValueError):
        gns.noise_scale_terms(model, 1)


def test_ema_is_bias_corrected():
    gns = _load("gradient_noise_scale")
    e = gns.EMA(0.9)
    assert e.update(3.0) == pytest.approx(3.0)
    assert e.update(3.0) == pytest.approx(3.0)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_per_sample_norms_snr_and_norms_against_loops(reduction):
    """per_sample_norms: the mini-batch gradient SNR and every sample's gradient norm, from one
    pass each, equal those of a loop over samples, whatever the reduction and chunk sizes (the
    last chunk of 7 samples in chunks of 3 has one sample)."""
    ex = _load("per_sample_norms")
    model = curvopt.extend(_net(conv=True))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss(reduction=reduction))
    X, y = _data(n=7)
    grads = [torch.cat([g.flatten() for g in gs]) for gs in _sample_grads(model, X, y)]
    sizes = [p.numel() for p in model.parameters()]
    per_param = [torch.stack(gs) for gs in zip(*(g.split(sizes) for g in grads))]
    snr = ex.gradient_snr(model, lossfunc, X, y, batch_size=4)
    for (name, _), g in zip(model.named_parameters(), per_param):
        mean = g.mean(0)
        cov_trace = (g - mean).pow(2).sum(1).mean()
        assert snr[name] == pytest.approx((mean.pow(2).sum() / (cov_trace / 4)).item(), rel=1e-9)
    norms = ex.sample_grad_norms(model, lossfunc, X, y, chunk=3)
    expected = torch.stack([g.norm() for g in grads])
    torch.testing.assert_close(norms, expected, rtol=1e-9, atol=0)
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def test_conventions_dp_sgd_snippet_against_a_loop():
    """The DP-SGD snippet of docs/conventions.md, run as written, gives the clipped mean of the
    per-sample gradients of a loop (the point of that section: rows are ``∇ℓ_n / N``)."""
    text = (EXAMPLES.parent / "docs" / "conventions.md").read_text()
    section = text.split("### Per-sample gradients", 1)[1]
    snippet = section.split("```python\n", 1)[1].split("```", 1)[0]
    model = curvopt.extend(_net())
    X, y = _data(n=7)
    scope = {"torch": torch, "nn": nn, "curvopt": curvopt, "ext": ext, "model": model}
    scope.update(X=X, y=y, C=0.5, sigma=0.0)
    exec(snippet, scope)
    params = [p for p in model.parameters() if p.requires_grad]
    expected = [torch.zeros_like(p) for p in params]
    for grads in _sample_grads(model, X, y):
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        factor = min(1.0, 0.5 / (norm.item() + 1e-6))
        for e, g in zip(expected, grads):
            e += factor * g / len(X)
    assert any(min(1.0, 0.5 / torch.sqrt(sum(g.pow(2).sum() for g in gs)).item()) < 1
               for gs in _sample_grads(model, X, y))  # some samples are clipped
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.grad, e, rtol=1e-9, atol=1e-12)
