"""Subclasses of supported layers (API.md, "Subclasses"; docs/conventions.md).

A subclass that defines its own ``forward`` (a convolution's ``_conv_forward`` too) computes
something else than its parent: it never gets the parent's rule silently, but the generic rule
(``torch.func``) with a warning naming the subclass, and its per-sample gradients equal
``torch.func``'s in float64. A subclass that only adds methods keeps the parent's rule. A
quantity the generic rule has not (Kronecker factors) raises naming the subclass; a rule that
meets an input it did not expect raises curvopt's error naming the module, never torch's.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import DT, per_sample_grads_vmap
from torch import nn

import curvopt
from curvopt import extensions as ext
from curvopt.errors import UnsupportedKroneckerError, UnsupportedModuleError
from curvopt.layers import LayerRule, register, rule_for
from curvopt.layers.generic import GENERIC

# Each subclass is defined inside its test: the registry warns once per type.


def _linear_subclass():
    class ScaledLinear(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x) + 1

    return ScaledLinear(4, 3), (5, 4)


def _conv_subclass():
    class SquaredConv(nn.Conv2d):
        def forward(self, x):
            return super().forward(x) ** 2

    return SquaredConv(2, 3, 2), (5, 2, 4, 4)


def _conv_forward_subclass():
    class FlippedConv(nn.Conv2d):
        def _conv_forward(self, x, weight, bias):
            return super()._conv_forward(x, weight.flip(-1), bias)

    return FlippedConv(2, 3, 2), (5, 2, 4, 4)


def _layer_norm_subclass():
    class ChannelNorm(nn.LayerNorm):  # timm's LayerNorm2d's function, unregistered
        def forward(self, x):
            return super().forward(x.movedim(1, -1)).movedim(-1, 1)

    return ChannelNorm(3), (5, 3, 2, 2)


def _batch_norm_subclass():
    class NormTanh(nn.BatchNorm2d):
        def forward(self, x):
            return torch.tanh(super().forward(x))

    layer = NormTanh(2)
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5)
        layer.running_mean.uniform_(-0.5, 0.5)
    return layer.eval(), (5, 2, 3, 3)


SUBCLASSES = {
    "Linear": (_linear_subclass, "nn.Linear", "forward"),
    "Conv2d": (_conv_subclass, "nn.Conv2d", "forward"),
    "Conv2d._conv_forward": (_conv_forward_subclass, "nn.Conv2d", "_conv_forward"),
    "LayerNorm": (_layer_norm_subclass, "nn.LayerNorm", "forward"),
    "BatchNorm2d": (_batch_norm_subclass, "nn.BatchNorm2d", "forward"),
}


def _model(layer, shape):
    torch.manual_seed(0)
    layer = layer.to(DT)
    X = torch.randn(*shape, dtype=DT)
    with torch.no_grad():
        features = layer(X)[0].numel()
    model = nn.Sequential(layer, nn.Tanh(), nn.Flatten(), nn.Linear(features, 3).to(DT))
    return model, X, torch.randint(0, 3, (shape[0],))


@pytest.mark.parametrize("kind", SUBCLASSES)
def test_overriding_subclass_gets_the_generic_rule_and_exact_gradients(kind):
    build, parent, method = SUBCLASSES[kind]
    layer, shape = build()
    model, X, y = _model(layer, shape)
    with pytest.warns(UserWarning, match=rf"{type(layer).__name__} subclasses {parent} but") as w:
        curvopt.extend(model)
    assert f"something else in its {method}" in str(w[0].message)
    assert rule_for(layer) is GENERIC
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    with curvopt.collect(ext.BatchGrad()):
        lossfunc(model(X), y).backward()
    expected = per_sample_grads_vmap(model, nn.CrossEntropyLoss(), X, y)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad_batch, expected[name], rtol=1e-9, atol=1e-12)


def test_parent_rule_on_a_subclass_would_be_wrong():
    """The reason for the rule: the Linear rule's per-sample gradients of ``2 W x + 1``
    differ from the true ones by the factor 2, so following the subclass is never silent."""
    layer, shape = _linear_subclass()
    model, X, y = _model(layer, shape)
    with pytest.warns(UserWarning):
        curvopt.extend(model)
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    with curvopt.collect(ext.BatchGrad()):
        lossfunc(model(X), y).backward()
    expected = per_sample_grads_vmap(model, nn.CrossEntropyLoss(), X, y)["0.weight"]
    assert torch.allclose(model[0].weight.grad_batch, expected)
    assert not torch.allclose(model[0].weight.grad_batch / 2, expected)


def test_subclass_without_its_own_forward_keeps_the_parent_rule():
    class NamedLinear(nn.Linear):
        def describe(self):
            return f"{self.in_features} -> {self.out_features}"

    class MyLSTM(nn.LSTM):
        pass

    layer = NamedLinear(4, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model, X, y = _model(layer, (5, 4))
        curvopt.extend(model)
        assert rule_for(layer) is rule_for(nn.Linear(1, 1))
        assert rule_for(MyLSTM(2, 2)) is rule_for(nn.LSTM(2, 2)) is rule_for(nn.GRU(2, 2))
        lossfunc = curvopt.extend(nn.CrossEntropyLoss())
        with curvopt.collect(ext.BatchGrad(), ext.KFLR()):
            lossfunc(model(X), y).backward()
    expected = per_sample_grads_vmap(model, nn.CrossEntropyLoss(), X, y)
    torch.testing.assert_close(layer.weight.grad_batch, expected["0.weight"])
    assert len(layer.weight.kflr) == 2  # the Linear rule's Kronecker factors


def test_kronecker_error_names_the_subclass():
    layer, shape = _linear_subclass()
    model, X, y = _model(layer, shape)
    with pytest.warns(UserWarning):
        curvopt.extend(model)
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    with pytest.raises(UnsupportedKroneckerError) as error:
        with curvopt.collect(ext.KFAC()):
            lossfunc(model(X), y).backward()
    message = str(error.value)
    assert "'0' (ScaledLinear)" in message
    assert "ScaledLinear subclasses nn.Linear but computes something else in its forward" in message


def test_batch_norm_subclass_in_training_mode_names_the_subclass():
    layer, shape = _batch_norm_subclass()
    model, X, y = _model(layer, shape)
    with pytest.warns(UserWarning):
        curvopt.extend(model.train())
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    with pytest.raises(UnsupportedModuleError) as error:
        with curvopt.collect(ext.BatchGrad()):
            lossfunc(model(X), y).backward()
    message = str(error.value)
    assert "NormTanh subclasses nn.BatchNorm2d but computes something else" in message
    assert "BatchNorm in training mode" in message


class _Doubler(nn.Module):
    """``y = 2 x * w``, with a rule that expects a matrix input."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3, dtype=DT))

    def forward(self, x):
        return 2 * x * self.weight


@register(_Doubler)
class _MatrixOnlyRule(LayerRule):
    def batch_grad(self, call, name, out=None):
        x, g = call.input, call.grad_out
        return torch.einsum("ni,ni->ni", 2 * x, g)  # a torch error on a 3-D input


def test_rule_meeting_an_unexpected_shape_raises_curvopts_error():
    model = curvopt.extend(nn.Sequential(_Doubler(), nn.Flatten(), nn.Linear(6, 2).to(DT)))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    X, y = torch.randn(4, 2, 3, dtype=DT), torch.randint(0, 2, (4,))
    with pytest.raises(UnsupportedModuleError) as error:
        with curvopt.collect(ext.BatchGrad()):
            lossfunc(model(X), y).backward()
    message = str(error.value)
    assert "module '0' (_Doubler)" in message
    assert "its rule _MatrixOnlyRule failed on this call's inputs" in message
    assert isinstance(error.value.__cause__, RuntimeError)
    model2 = curvopt.extend(nn.Sequential(_Doubler(), nn.Linear(3, 2).to(DT)))
    with curvopt.collect(ext.BatchGrad()):  # the shape it expects: exact
        lossfunc(model2(X[:, 0]), y).backward()
    torch.testing.assert_close(model2[0].weight.grad_batch.sum(0), model2[0].weight.grad)
