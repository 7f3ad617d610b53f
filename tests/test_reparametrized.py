"""Layers with reparametrized weights (weight norm, spectral norm, any
``torch.nn.utils.parametrize`` function, and the older ``weight_norm``/``spectral_norm``
hooks): per-sample gradients and GGN diagonals of the originals (the parameters
``named_parameters()`` lists) against float64 ``torch.func`` references; what cannot be
computed raises, naming the parametrization and the fix."""

import warnings

import pytest
import reference
import torch
from conftest import DT, assert_close, assert_no_attributes, check_against_loop, trainable
from torch import nn
from torch.nn.utils import parametrizations, parametrize

import curvopt
from curvopt import extensions as ext
from curvopt.errors import CurvoptError

N = 4


class Scale(nn.Module):
    """A custom parametrization: ``w = 2 tanh(θ)``."""

    def forward(self, theta):
        return 2 * torch.tanh(theta)


def _old_weight_norm(layer, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return nn.utils.weight_norm(layer, **kw)


def _custom(layer):
    parametrize.register_parametrization(layer, "weight", Scale())
    return layer


def _eval_spectral(layer):
    layer = parametrizations.spectral_norm(layer)
    for _ in range(3):  # a few power iterations, then frozen
        layer(torch.randn(2, layer.in_features, dtype=DT))
    return layer.eval()


WRAPPERS = {
    "weight_norm": parametrizations.weight_norm,
    "weight_norm-dim1": lambda layer: parametrizations.weight_norm(layer, dim=1),
    "old-weight_norm": _old_weight_norm,
    "old-weight_norm-dimNone": lambda layer: _old_weight_norm(layer, dim=None),
    "custom": _custom,
    "orthogonal": parametrizations.orthogonal,
    "spectral_norm-eval": _eval_spectral,
}


def _mlp(wrap):
    return nn.Sequential(wrap(nn.Linear(4, 4).to(DT)), nn.Tanh(), nn.Linear(4, 3).to(DT))


def _cnn(wrap):
    conv = nn.Conv1d(3, 2, 2).to(DT)
    return nn.Sequential(wrap(conv), nn.Sigmoid(), nn.Flatten(), nn.Linear(8, 3).to(DT))


def _inputs(arch):
    return torch.randn(N, 4, dtype=DT) if arch == "mlp" else torch.randn(N, 3, 5, dtype=DT)


def _build(arch, case):
    """The same model on every call (the old weight_norm's modules cannot be deep-copied)."""
    torch.manual_seed(0)
    wrap = WRAPPERS[case]
    if arch == "cnn" and case == "orthogonal":
        pytest.skip("orthogonal needs a matrix weight")
    if case == "spectral_norm-eval" and arch == "cnn":
        wrap = lambda conv: _eval_spectral_conv(conv)  # noqa: E731
    return (_mlp if arch == "mlp" else _cnn)(wrap)


def _eval_spectral_conv(conv):
    conv = parametrizations.spectral_norm(conv)
    for _ in range(3):
        conv(torch.randn(2, 3, 5, dtype=DT))
    return conv.eval()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("case", list(WRAPPERS))
@pytest.mark.parametrize("arch", ["mlp", "cnn"])
def test_first_order_of_the_originals(arch, case, reduction, seed):
    plain = _build(arch, case)
    x, y = _inputs(arch), torch.randint(0, 3, (N,))
    lossfunc = nn.CrossEntropyLoss(reduction=reduction)
    model = curvopt.extend(_build(arch, case))
    _, ref = check_against_loop(plain, lossfunc, x, y, model=model)
    assert any("original" in k or "_g" in k or "_v" in k for k in ref)


@pytest.mark.parametrize("case", ["weight_norm", "old-weight_norm", "custom"])
@pytest.mark.parametrize("arch", ["mlp", "cnn"])
def test_ggn_diagonals_of_the_originals(arch, case, seed):
    plain = _build(arch, case)
    x, y = _inputs(arch), torch.randint(0, 3, (N,))
    blocks, per_sample = reference.ggn(plain, nn.CrossEntropyLoss(), x, y)
    model = curvopt.extend(_build(arch, case))
    loss = curvopt.extend(nn.CrossEntropyLoss())(model(x), y)
    with curvopt.collect(ext.DiagGGNExact(), ext.BatchDiagGGNExact()):
        loss.backward()
    for name, p in trainable(model).items():
        assert_close(p.diag_ggn_exact, torch.diagonal(blocks[name]).reshape(p.shape), name)
        assert_close(p.diag_ggn_exact_batch, per_sample[name], name)


UNSUPPORTED = {
    "DiagHessian": (ext.DiagHessian, "reparametrized parameter 'weight'"),
    "KFRA": (ext.KFRA, "reparametrized"),
    "KFLR": (ext.KFLR, "original of the reparametrized parameter 'weight'"),
}


@pytest.mark.parametrize("extension", list(UNSUPPORTED))
@pytest.mark.parametrize("case", ["weight_norm", "old-weight_norm"])
def test_unsupported_quantities_raise(case, extension, seed):
    make, match = UNSUPPORTED[extension]
    model = curvopt.extend(_build("mlp", case))
    loss = curvopt.extend(nn.CrossEntropyLoss())(model(_inputs("mlp")), torch.randint(0, 3, (N,)))
    with pytest.raises(CurvoptError, match=match), curvopt.collect(make()):
        loss.backward()
    assert_no_attributes(model)


@pytest.mark.parametrize("old", [False, True])
def test_spectral_norm_in_training_mode_names_the_fix(old, seed):
    layer = nn.Linear(4, 4).to(DT)
    layer = nn.utils.spectral_norm(layer) if old else parametrizations.spectral_norm(layer)
    model = curvopt.extend(nn.Sequential(layer, nn.Tanh(), nn.Linear(4, 3).to(DT)))
    loss = curvopt.extend(nn.CrossEntropyLoss())(model(_inputs("mlp")), torch.randint(0, 3, (N,)))
    with (
        pytest.raises(CurvoptError, match=r"spectral norm.*\.eval\(\)"),
        curvopt.collect(ext.BatchGrad()),
    ):
        loss.backward()
    assert_no_attributes(model)
