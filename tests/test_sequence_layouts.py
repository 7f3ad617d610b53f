"""Curvature for every loss layout users write on sequence outputs (issue 9 item 1).

The model sees a batch of ``N`` sequences ``x [N, T, D]``; the loss sees its output in one of
the layouts of ``LAYOUTS`` (PyTorch's K-dim ``[N, C, T]``, rows flattened batch-first or
sequence-first, ``ignore_index`` with a sample whose rows are all ignored, class weights, label
smoothing, MSE / BCE on ``[N, T, D]`` and flattened). docs/conventions.md: ``G`` and ``H`` are
those of the loss as computed, per-sample quantities are per sample of the model's batch.
References: ``tests/reference.py`` (torch.func). Also the cases where Eschenhagen et al. (2023)
show KFAC exact: a deep linear network with the loss over all positions ("expand") and with the
shared dimension reduced before the loss ("reduce").
"""

from __future__ import annotations

import copy

import pytest
import reference
import torch
from conftest import DT, assert_close, assert_unbiased, trainable
from torch import nn

import curvopt
from curvopt import extensions as ext

N, T, D, C = 3, 4, 3, 4


def _flat(lossfunc, transpose=False):
    """``lossfunc(out.reshape(-1, C), y.reshape(-1...))``; sequence-first: ``[T, N, C]`` rows."""

    def loss_on(out, y, other=None):
        f = lossfunc if other is None else other
        if transpose:
            out, y = out.transpose(0, 1), y.transpose(0, 1)
        return f(out.reshape(-1, out.shape[-1]), y.reshape(-1, *y.shape[2:]))

    return loss_on


def _kdim(lossfunc):
    def loss_on(out, y, other=None):
        return (lossfunc if other is None else other)(out.transpose(1, 2), y)

    return loss_on


def _as_is(lossfunc):
    def loss_on(out, y, other=None):
        return (lossfunc if other is None else other)(out, y)

    return loss_on


def _classes(g):
    return torch.randint(0, C, (N, T), generator=g)


def _ignored(g):
    """``-100`` (the default ``ignore_index``) on some rows and on every row of sample 1."""
    y = _classes(g)
    y[0, 0] = y[2, 3] = -100
    y[1] = -100
    return y


_WEIGHT = torch.tensor([0.5, 2.0, 1.0, 1.5], dtype=DT)

#: layout -> (loss_on(lossfunc) builder, loss class, loss options, target maker)
LAYOUTS = {
    "ce_kdim": (_kdim, nn.CrossEntropyLoss, {}, _classes),
    "ce_flat": (_flat, nn.CrossEntropyLoss, {}, _classes),
    "ce_flat_seq_first": (lambda f: _flat(f, True), nn.CrossEntropyLoss, {}, _classes),
    "ce_ignore_index": (_flat, nn.CrossEntropyLoss, {}, _ignored),
    "ce_kdim_ignore_index": (_kdim, nn.CrossEntropyLoss, {}, _ignored),
    "ce_class_weights": (_flat, nn.CrossEntropyLoss, {"weight": _WEIGHT}, _ignored),
    "ce_label_smoothing": (_flat, nn.CrossEntropyLoss, {"label_smoothing": 0.1}, _classes),
    "mse_3d": (_as_is, nn.MSELoss, {}, lambda g: torch.randn(N, T, C, generator=g, dtype=DT)),
    "mse_flat": (_flat, nn.MSELoss, {}, lambda g: torch.randn(N, T, C, generator=g, dtype=DT)),
    "bce_3d": (
        _as_is,
        nn.BCEWithLogitsLoss,
        {},
        lambda g: torch.rand(N, T, C, generator=g, dtype=DT),
    ),
    "bce_flat": (
        _flat,
        nn.BCEWithLogitsLoss,
        {},
        lambda g: torch.rand(N, T, C, generator=g, dtype=DT),
    ),
}
REDUCTIONS = ["mean", "sum"]


def _model():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(D, 5), nn.Tanh(), nn.Linear(5, C)).to(DT)


def _setup(layout, reduction):
    build, cls, options, target = LAYOUTS[layout]
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(N, T, D, generator=g, dtype=DT), target(g)
    lossfunc = cls(reduction=reduction, **options)
    return _model(), lossfunc, build(lossfunc), x, y


def _collect(plain, lossfunc, loss_on, x, y, *extensions):
    model = curvopt.extend(copy.deepcopy(plain))
    loss = loss_on(model(x), y, curvopt.extend(copy.deepcopy(lossfunc)))
    with curvopt.collect(*extensions):
        loss.backward()
    return model


_CACHE: dict = {}


def _reference(kind, layout, reduction, *args):
    key = (kind, layout, reduction, *args)
    if key not in _CACHE:
        plain, _, loss_on, x, y = _setup(layout, reduction)
        _CACHE[key] = getattr(reference, kind)(plain, loss_on, x, y, 0, *args)
    return _CACHE[key]


def _kron_expected(layout, reduction, approx, model):
    layers = _reference("kronecker", layout, reduction, approx)
    blocks, _ = _reference("ggn", layout, reduction)
    expected = {f"{k}.weight": [b, a] for k, (b, a) in layers.items()}
    for name, p in trainable(model).items():
        if p.dim() == 1:
            expected[name] = [blocks[name]]
    return expected


QUANTITIES = {
    "DiagGGNExact": (ext.DiagGGNExact, "diag_ggn_exact"),
    "BatchDiagGGNExact": (ext.BatchDiagGGNExact, "diag_ggn_exact_batch"),
    "DiagHessian": (ext.DiagHessian, "diag_h"),
    "BatchDiagHessian": (ext.BatchDiagHessian, "diag_h_batch"),
    "KFLR-expand": (lambda: ext.KFLR(kfac_approx="expand"), "kflr"),
    "KFLR-reduce": (lambda: ext.KFLR(kfac_approx="reduce"), "kflr"),
}


def _expected(quantity, layout, reduction, model):
    if quantity.startswith("KFLR"):
        return _kron_expected(layout, reduction, quantity.split("-")[1], model)
    kind = "hessian" if "Hessian" in quantity else "ggn"
    full, per_sample = _reference(kind, layout, reduction)
    if quantity.startswith("Batch"):
        return per_sample
    if kind == "ggn":
        return {k: torch.diagonal(b).reshape(per_sample[k].shape[1:]) for k, b in full.items()}
    return full


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("quantity", list(QUANTITIES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout(layout, quantity, reduction):
    plain, lossfunc, loss_on, x, y = _setup(layout, reduction)
    make, attr = QUANTITIES[quantity]
    model = _collect(plain, lossfunc, loss_on, x, y, make())
    expected = _expected(quantity, layout, reduction, model)
    for name, p in trainable(model).items():
        value = getattr(p, attr, None)
        if isinstance(expected[name], list):
            assert isinstance(value, list) and len(value) == len(expected[name]), f"{name}.{attr}"
            for i, (v, e) in enumerate(zip(value, expected[name])):
                assert_close(v, e, f"{layout} {name}.{attr}[{i}]")
        else:
            assert_close(value, expected[name], f"{layout} {name}.{attr}")


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_mc_unbiased(layout, reduction):
    """``DiagGGNMC`` (and its per-sample terms) is unbiased for every layout: independent
    samples per row, the loss's own scaling."""
    plain, lossfunc, loss_on, x, y = _setup(layout, reduction)
    blocks, per_sample = _reference("ggn", layout, reduction)
    draws = {}
    for seed in range(10):
        torch.manual_seed(seed)
        model = _collect(
            plain, lossfunc, loss_on, x, y, ext.DiagGGNMC(1000), ext.BatchDiagGGNMC(1000)
        )
        for name, p in trainable(model).items():
            draws.setdefault(name, []).append((p.diag_ggn_mc, p.diag_ggn_mc_batch))
    for name, values in draws.items():
        exact = torch.diagonal(blocks[name]).reshape(per_sample[name].shape[1:])
        assert_unbiased(torch.stack([v[0] for v in values]), exact, f"{layout} {name}.diag_ggn_mc")
        assert_unbiased(
            torch.stack([v[1] for v in values]),
            per_sample[name],
            f"{layout} {name}.diag_ggn_mc_batch",
        )


# ------------------------------------------------------------------------------ exact KFAC cases


class _DeepLinear(nn.Module):
    """``x [N, T, D] -> Linear -> Linear``; ``reduce=True``: mean over positions in between."""

    def __init__(self, reduce_positions: bool):
        super().__init__()
        self.reduce_positions = reduce_positions
        self.a = nn.Linear(D, 5)
        self.b = nn.Linear(5, C)

    def forward(self, x):
        h = self.a(x)
        return self.b(h.mean(1) if self.reduce_positions else h)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("case", ["expand-3d", "expand-flat", "reduce"])
def test_kfac_exact_cases(case, reduction):
    """Eschenhagen et al. (2023): for a deep linear network with MSE, ``kron(B, A)`` of
    KFLR-expand is the exact GGN block when the loss covers every position, and KFLR-reduce is
    when the shared dimension is reduced before the loss -- for any ``N``."""
    approx = case.split("-")[0]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        plain = _DeepLinear(approx == "reduce").to(DT)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(N, T, D, generator=g, dtype=DT)
    lossfunc = nn.MSELoss(reduction=reduction)
    y = torch.randn(*((N, C) if approx == "reduce" else (N, T, C)), generator=g, dtype=DT)
    loss_on = _flat(lossfunc) if case == "expand-flat" else _as_is(lossfunc)
    model = _collect(plain, lossfunc, loss_on, x, y, ext.KFLR(kfac_approx=approx))
    blocks, _ = reference.ggn(plain, loss_on, x, y)
    for name, p in trainable(model).items():
        factors = p.kflr
        full = torch.kron(*factors) if len(factors) == 2 else factors[0]
        assert_close(full, blocks[name], f"{case} {name}.kflr")
