"""The Kronecker optimizers on models with parameters that have no Kronecker factorisation,
with their defaults (issue 51, items 4-6), float64:

* ``damping`` defaults to ``1e-3`` (``KFAC(params, lr=0.1)`` constructs and steps as
  ``damping=1e-3``), positional use unchanged;
* ``EKFAC``'s ``fallback="sgd"`` steps such a parameter by ``lr · g`` while the others step as
  EKFAC; ``fallback="diagonal"`` (``KFAC``'s and ``EKFAC``'s) by ``g / (c + λ)``, ``c`` the GGN
  diagonal of the columns the factors come from, from the first step on, as ``DiagGGNNewton``;
* ``fallback="diagonal"`` is the default, announced by one warning naming the parameters;
  ``fallback=None`` raises, naming the module;
* a ViT (patch embedding, class token, position embedding, ``nn.TransformerEncoder``) trains
  with ``KFAC(params, lr=...)`` and ``EKFAC(params, lr=...)`` alone.
"""

from __future__ import annotations

import inspect
import warnings
from functools import partial

import pytest
import torch
from torch import nn

import curvopt
from curvopt.errors import UnsupportedKroneckerError
from curvopt.optim import EKFAC, KFAC, DiagGGNNewton
from curvopt.optim.options import DEFAULT_REDUCTION_DAMPING

DT = torch.float64
N = 6


class ExpMix(nn.Module):
    """``x @ exp(w)``: a raw 2-D weight used non-linearly, without a Kronecker factorisation
    for good (a one-dimensional parameter has its exact block as factor, so it is 2-D)."""

    def __init__(self, d: int):
        super().__init__()
        self.w = nn.Parameter(0.1 * torch.randn(d, d))

    def forward(self, x):
        return x @ torch.exp(self.w)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.mix = ExpMix(4)
        self.b = nn.Linear(4, 3)

    def forward(self, x):
        return self.b(self.mix(torch.tanh(self.a(x))))


def _net(extend=True):
    torch.manual_seed(0)
    model = Net().to(DT)
    return curvopt.extend(model) if extend else model


def _batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, 3, generator=g, dtype=DT), torch.randint(0, 3, (N,), generator=g)


def _step(model, opt, batch, lossfunc=None):
    lossfunc = lossfunc or curvopt.extend(nn.CrossEntropyLoss())
    opt.zero_grad()
    loss = lossfunc(model(batch[0]), batch[1])
    loss.backward()
    opt.step()
    return loss.item()


def _quiet(make):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make()


# ------------------------------------------------------------------------- damping (item 6)
@pytest.mark.parametrize("optimizer", [KFAC, EKFAC, DiagGGNNewton])
def test_damping_defaults_to_relative(optimizer):
    """``damping=None`` by default (``λ = α s``, ``tests/test_reduction_scaled_damping.py``);
    a damping given positionally or by keyword is the same absolute ``λ``."""
    assert inspect.signature(optimizer).parameters["damping"].default is None
    steps = []
    for make in (
        lambda ps: optimizer(ps, lr=0.1, damping=1e-3),
        lambda ps: optimizer(ps, 0.1, 1e-3),  # positionally, as before
    ):
        torch.manual_seed(0)
        model = curvopt.extend(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).to(DT))
        opt = make(model.parameters())
        assert opt.param_groups[0]["damping"] == 1e-3
        torch.manual_seed(2)
        _step(model, opt, _batch())
        steps.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(steps[0], steps[1])
    opt = optimizer([nn.Parameter(torch.zeros(2, 2))], lr=0.1)
    assert opt.param_groups[0]["damping"] is None
    assert opt.damping() == DEFAULT_REDUCTION_DAMPING


# ------------------------------------------------------------------------- fallbacks (item 5)
def _twin_without(name):
    """The model of :func:`_net` with its parameter ``name`` frozen: its optimizer never sees
    it."""
    twin = _net()
    twin.get_parameter(name).requires_grad_(False)
    return twin


def test_ekfac_fallback_sgd_steps_the_gradient_and_the_others_as_ekfac():
    model = _net()
    twin = _twin_without("mix.w")
    make = lambda ps: EKFAC(ps, 0.1, 1e-2, "kflr", fallback="sgd", kl_clip=None)  # noqa: E731
    opt, twin_opt = (
        _quiet(lambda: make(model.parameters())),
        make([p for p in twin.parameters() if p.requires_grad]),
    )
    before = model.mix.w.detach().clone()
    _quiet(lambda: _step(model, opt, _batch(1)))
    _step(twin, twin_opt, _batch(1))  # the first step: after it, mix.w differs
    assert torch.equal(model.mix.w.detach(), before - 0.1 * model.mix.w.grad)
    for name in ("a.weight", "a.bias", "b.weight", "b.bias"):
        torch.testing.assert_close(
            model.get_parameter(name), twin.get_parameter(name), rtol=1e-12, atol=1e-14
        )
    assert not torch.equal(model.a.weight, _net().a.weight)  # they moved
    before = model.mix.w.detach().clone()
    _quiet(lambda: _step(model, opt, _batch(2)))  # and on: the gradient
    assert torch.equal(model.mix.w.detach(), before - 0.1 * model.mix.w.grad)


def _exact_diagonal(model, batch, name):
    """The exact GGN diagonal of parameter ``name`` at ``model``'s parameters, from a twin (a
    backward pass of ``model`` would join its optimizer's window)."""
    twin = _net()
    twin.load_state_dict(model.state_dict())
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    with curvopt.collect(curvopt.extensions.DiagGGNExact()):
        lossfunc(twin(batch[0]), batch[1]).backward()
    return twin.get_parameter(name).diag_ggn_exact


@pytest.mark.parametrize("basis_source", ["last_refresh", "current"])
def test_ekfac_fallback_diagonal_is_the_diag_ggn_newton_step_at_every_step(basis_source):
    """As below for ``EKFAC`` with either basis: the diagonal of the factors it collects
    beside (``p.kflr_diagonal``) at its default ``basis_source="last_refresh"``, its own
    extension's (``p.ekfac_diagonal``) with the paper's ``"current"``."""
    written = "kflr_diagonal" if basis_source == "last_refresh" else "ekfac_diagonal"
    _check_fallback_diagonal(partial(EKFAC, basis_source=basis_source), written)


def test_fallback_diagonal_is_the_diag_ggn_newton_step_at_every_step():
    """``curvature="kflr"``: ``mix.w`` steps by ``g / (diag(G) + λ)`` with the exact GGN
    diagonal of the pass (``p.kflr_diagonal``), from the first step on, while the other
    parameters step by their Kronecker curvature."""
    _check_fallback_diagonal(KFAC, "kflr_diagonal")


def _check_fallback_diagonal(optimizer, written):
    model = _net()
    lr, damping = 0.1, 1e-2
    opt = _quiet(lambda: optimizer(model.parameters(), lr, damping, "kflr", kl_clip=None))
    for seed in (1, 2, 3):
        batch = _batch(seed)
        diag = _exact_diagonal(model, batch, "mix.w")
        before = model.mix.w.detach().clone()
        _quiet(lambda batch=batch: _step(model, opt, batch))
        expected = before - lr * model.mix.w.grad / (diag + damping)
        torch.testing.assert_close(model.mix.w.detach(), expected, rtol=1e-12, atol=1e-14)
    assert torch.equal(opt.state[model.mix.w]["fallback_diagonal"], getattr(model.mix.w, written))


@pytest.mark.parametrize("optimizer", [KFAC, EKFAC])
def test_monte_carlo_fallback_diagonal_is_diag_ggn_newton_mc_on_the_same_draw(optimizer):
    """The default ``curvature="kfac"``: the Monte-Carlo GGN diagonal of the sampled columns
    the factors come from, ``DiagGGNNewton(curvature="mc")``'s step on the same draw (the
    first step: after it the other parameters differ)."""
    model, other = _net(), _net()
    opt = _quiet(lambda: optimizer(model.parameters(), 0.1, 1e-2, kl_clip=None))
    diag = DiagGGNNewton(other.parameters(), 0.1, 1e-2, "mc", kl_clip=None)
    torch.manual_seed(5)
    _quiet(lambda: _step(model, opt, _batch(1)))
    torch.manual_seed(5)
    _step(other, diag, _batch(1))
    torch.testing.assert_close(model.mix.w, other.mix.w, rtol=1e-12, atol=1e-14)
    assert not torch.equal(model.mix.w, _net().mix.w)


def test_kfac_fallback_diagonal_is_the_diag_ggn_newton_step():
    """KFLR's fallback diagonal is the exact GGN diagonal: ``DiagGGNNewton("exact")``'s step
    (the first: after it the other parameters differ)."""
    model, other = _net(), _net()
    opt = _quiet(lambda: KFAC(model.parameters(), 0.1, 1e-2, "kflr", kl_clip=None))
    diag = DiagGGNNewton(other.parameters(), 0.1, 1e-2, "exact", kl_clip=None)
    _quiet(lambda: _step(model, opt, _batch(1)))
    _step(other, diag, _batch(1))
    torch.testing.assert_close(model.mix.w, other.mix.w, rtol=1e-12, atol=1e-14)
    assert not torch.equal(model.a.weight, other.a.weight)  # Kronecker against diagonal


@pytest.mark.parametrize("optimizer", [KFAC, EKFAC])
def test_the_default_fallback_is_announced_once(optimizer):
    model = _net()
    opt = optimizer(model.parameters(), lr=0.1)
    assert opt.defaults["fallback"] == "diagonal"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = [_step(model, opt, _batch(1)) for _ in range(4)]
    messages = [str(w.message) for w in caught if "Kronecker" in str(w.message)]
    assert len(messages) == 1, messages
    assert "['mix.w']" in messages[0] and "fallback=None" in messages[0]
    assert losses[-1] < losses[0]
    assert "mix.w" not in str(messages[0].split("]")[1])  # named once, in the list


@pytest.mark.parametrize("optimizer", [KFAC, EKFAC])
def test_fallback_none_raises_naming_the_module(optimizer):
    model = _net()
    opt = optimizer(model.parameters(), lr=0.1, fallback=None)
    named = r"module 'mix' \(\w+\): parameter 'w' has no Kronecker"
    with pytest.raises(UnsupportedKroneckerError, match=named):
        _step(model, opt, _batch(1))


@pytest.mark.parametrize("optimizer", [KFAC, EKFAC])
def test_a_model_not_extended_still_raises_with_the_default_fallback(optimizer):
    model = _net(extend=False)
    opt = optimizer(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"has no `(kfac|ekfac)`.*curvopt\.extend"):
        _step(model, opt, _batch(1), nn.CrossEntropyLoss())
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


# ------------------------------------------------------------------------- a ViT (item 4)
class ViT(nn.Module):
    """Patch embedding (``Conv2d``), class token ``[1, 1, d]`` concatenated to the patches,
    position embedding ``[1, T, d]`` added over the batch, ``nn.TransformerEncoder``
    (``dropout=0.0``), final ``LayerNorm``, head on the class token."""

    def __init__(self, d=8, heads=2, classes=3):
        super().__init__()
        self.patch = nn.Conv2d(1, d, kernel_size=4, stride=4)
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        self.pos = nn.Parameter(torch.zeros(1, 5, d))
        layer = nn.TransformerEncoderLayer(d, heads, 2 * d, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, images):
        x = self.patch(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        return self.head(self.norm(self.encoder(x))[:, 0])


@pytest.mark.parametrize("optimizer", [KFAC, EKFAC])
def test_a_vit_trains_with_the_defaults(optimizer):
    torch.manual_seed(0)
    model = curvopt.extend(ViT().to(DT))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    g = torch.Generator().manual_seed(1)
    X, y = torch.randn(16, 1, 8, 8, generator=g, dtype=DT), torch.randint(0, 3, (16,), generator=g)
    opt = optimizer(model.parameters(), lr=0.1)  # nothing else
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = [_step(model, opt, (X, y), lossfunc) for _ in range(20)]
    announced = [str(w.message) for w in caught if "no Kronecker factorisation" in str(w.message)]
    assert len(announced) <= 1, announced  # none once every parameter has factors
    assert losses[-1] < 0.5 * losses[0], losses
    for name in ("cls", "pos"):
        assert not torch.equal(model.get_parameter(name), start[name]), name
