"""A backward pass inside ``collect`` through modules that ``curvopt.extend`` did not reach: with
nothing extended it raises, naming ``curvopt.extend`` (it wrote nothing before); with only a
submodule extended, the extended part gets its quantities (against a loop over samples), the
rest nothing, and one warning names the module that was left out."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import curvopt
from curvopt import extensions as ext
from curvopt.errors import UnsupportedModuleError

DT = torch.float64


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(5, 3, generator=g, dtype=DT), torch.randint(0, 2, (5,), generator=g)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(DT)


@pytest.mark.parametrize("extension", [ext.BatchGrad(), ext.Variance(), ext.DiagGGNExact()])
@pytest.mark.parametrize("module_loss", [False, True])
def test_nothing_extended_raises_naming_extend(extension, module_loss):
    model, (x, y) = _mlp(), _data()
    loss_of = nn.CrossEntropyLoss() if module_loss else F.cross_entropy
    with pytest.raises(UnsupportedModuleError, match=r"Linear.*curvopt\.extend\(model\)"):
        with curvopt.collect(extension):
            loss_of(model(x), y).backward()
    assert not any(hasattr(p, extension.attr) for p in model.parameters())


def test_an_input_gradient_through_a_plain_model_is_not_a_pass_to_collect():
    """``torch.autograd.grad`` w.r.t. the input accumulates into no parameter: ignored, as for
    extended models."""
    model, (x, y) = _mlp(), _data()
    x.requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with curvopt.collect(ext.BatchGrad()):
            (gradient,) = torch.autograd.grad(F.cross_entropy(model(x), y), x)
    assert gradient.shape == x.shape


def _per_sample_grads(model, x, y):
    rows = []
    for n in range(len(x)):
        model.zero_grad()
        F.cross_entropy(model(x[n : n + 1]), y[n : n + 1], reduction="sum").backward()
        rows.append([p.grad.clone() / len(x) for p in model.parameters()])
    return [torch.stack(r) for r in zip(*rows)]


def test_only_a_submodule_extended_fills_that_part_and_warns_once_naming_the_rest():
    model, (x, y) = _mlp(), _data()
    expected = _per_sample_grads(model, x, y)
    curvopt.extend(model[2])
    for attempt in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.zero_grad()
            with curvopt.collect(ext.BatchGrad()):
                F.cross_entropy(model(x), y).backward()
        messages = [str(w.message) for w in caught if "not extended" in str(w.message)]
        assert len(messages) == (1 if attempt == 0 else 0), messages
        if messages:
            assert "Linear" in messages[0] and "extend the whole model" in messages[0]
    first, head = list(model[0].parameters()), list(model[2].parameters())
    assert not any(hasattr(p, "grad_batch") for p in first)
    for p, reference in zip(head, expected[2:]):
        torch.testing.assert_close(p.grad_batch, reference, rtol=1e-12, atol=1e-14)


def test_frozen_unextended_modules_in_the_pass_are_not_reported():
    """A frozen feature extractor (no trainable parameters) in front of an extended head."""
    model, (x, y) = _mlp(), _data()
    for p in model[0].parameters():
        p.requires_grad_(False)
    curvopt.extend(model[2])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with curvopt.collect(ext.BatchGrad()):
            F.cross_entropy(model(x), y).backward()
    assert model[2].weight.grad_batch.shape == (5, 2, 4)
