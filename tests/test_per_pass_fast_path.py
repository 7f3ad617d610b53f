"""A pass of a graph structure seen before takes the plan's fast path (issue 30 item 1): the
row layout is read from the plan (no probe, no ``RowLayout`` made, no ``bincount``), the
parameters' gradient accumulators are read off the walk (no view per parameter), and the
results stay what the first pass wrote. What must run on every pass still does: a wrong
per-sample gradient, a term from outside the extended loss, or a graph that now mixes samples
raises on the second pass exactly as on a first one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import curvopt
from curvopt import extensions as ext
from curvopt.guards import checks, participation
from curvopt.core.layouts import RowLayout
from curvopt.engine import rows
from curvopt.errors import UnsupportedModuleError
from curvopt.layers.linear import LinearRule
from curvopt.layers.registry import LayerRule

DT = torch.float64


class _Net(nn.Module):
    """12 -> 10 -> 3 with a switch that makes the hidden layer mix samples."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(12, 10), nn.Linear(10, 3)
        self.mix = False

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h - h.mean(0) if self.mix else h)


def _setup():
    torch.manual_seed(0)
    model = curvopt.extend(_Net().to(DT))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    x, y = torch.randn(8, 12, dtype=DT), torch.randint(3, (8,))
    return model, lossfunc, x, y


def _pass(model, lossfunc, x, y, extension, penalty=0.0):
    model.zero_grad(set_to_none=True)
    out = model(x)
    with curvopt.collect(extension()):
        (lossfunc(out, y) + penalty * (out**2).sum()).backward()
    return {name: _copy(getattr(p, extension.attr)) for name, p in model.named_parameters()}


def _copy(value):
    """A tensor's copy, or the copies of a list of factors."""
    return value.clone() if isinstance(value, torch.Tensor) else [f.clone() for f in value]


def _forget(model, attr):
    """Drop ``attr`` from every parameter (a failed pass must write none)."""
    for p in model.parameters():
        if hasattr(p, attr):
            delattr(p, attr)


@pytest.fixture
def counts(monkeypatch):
    """How often the first-pass work runs: row probes, layouts made, accumulators made."""
    found = {"probes": 0, "layouts": 0, "accumulators": 0}

    def counting(fn, key):
        def wrapped(*args, **kwargs):
            found[key] += 1
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(rows, "_verified", counting(rows._verified, "probes"))
    monkeypatch.setattr(RowLayout, "__init__", counting(RowLayout.__init__, "layouts"))
    monkeypatch.setattr(
        participation,
        "grad_accumulator",
        counting(participation.grad_accumulator, "accumulators"),
    )
    return found


def _per_sample_reference(model, lossfunc, x, y):
    """BatchGrad by a loop over samples (the loss's mean over N as a factor 1/N)."""
    grads = []
    for n in range(len(x)):
        model.zero_grad(set_to_none=True)
        (lossfunc(model(x[n : n + 1]), y[n : n + 1]) / len(x)).backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    return {name: torch.stack([g[name] for g in grads]) for name in grads[0]}


@pytest.mark.parametrize("extension", [ext.BatchGrad, ext.SumGradSquared, ext.DiagGGNExact])
def test_second_pass_takes_the_plan_and_writes_the_same(counts, extension):
    model, lossfunc, x, y = _setup()
    first = _pass(model, lossfunc, x, y, extension)
    assert counts["probes"] >= 1 and counts["layouts"] >= 1  # the first pass does the work
    for key in counts:
        counts[key] = 0
    second = _pass(model, lossfunc, x, y, extension)
    assert counts == {"probes": 0, "layouts": 0, "accumulators": 0}
    for name in first:
        assert torch.equal(first[name], second[name]), name
    if extension is ext.BatchGrad:
        reference = _per_sample_reference(model, lossfunc, x, y)
        for name in first:
            torch.testing.assert_close(second[name], reference[name], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mutated", ["weight", "bias"])
@pytest.mark.parametrize("extension", [ext.BatchGrad, ext.BatchL2Grad, ext.Variance])
def test_second_pass_still_checks_the_per_sample_sums(monkeypatch, extension, mutated):
    model, lossfunc, x, y = _setup()
    _pass(model, lossfunc, x, y, extension)
    _pass(model, lossfunc, x, y, extension)  # the structure's plan is cached and checked
    right = LinearRule.batch_grad

    def wrong(self, call, name, out=None):
        g = right(self, call, name, out)
        return g * 1.001 if name == mutated else g

    monkeypatch.setattr(LinearRule, "batch_grad", wrong)
    monkeypatch.setattr(LinearRule, "projected_sum", lambda *a, **k: None)  # the full check
    for method in ("batch_l2", "sum_grad_squared", "grad_sum"):  # every reduction from it
        monkeypatch.setattr(LinearRule, method, getattr(LayerRule, method))
    _forget(model, extension.attr)
    with pytest.raises(UnsupportedModuleError, match="receives gradient from outside"):
        _pass(model, lossfunc, x, y, extension)
    assert not hasattr(getattr(model.a, mutated), extension.attr)


@pytest.mark.parametrize(
    "extension, change, match",
    [
        (ext.DiagGGNExact, "penalty", "extended loss\\(es\\) alone"),
        (ext.KFAC, "penalty", "extended loss\\(es\\) alone"),
        (ext.BatchGrad, "mix", "mixes samples"),
        (ext.DiagGGNExact, "mix", "mixes samples"),
    ],
)
def test_a_changed_graph_raises_after_cached_passes(extension, change, match):
    """A term from outside the extended loss (the flow check, on every pass) or an op that now
    mixes samples (a new structure: probed again) raises after two passes of the old one."""
    model, lossfunc, x, y = _setup()
    _pass(model, lossfunc, x, y, extension)
    _pass(model, lossfunc, x, y, extension)
    model.mix = change == "mix"
    _forget(model, extension.attr)
    with pytest.raises(UnsupportedModuleError, match=match):
        _pass(model, lossfunc, x, y, extension, penalty=0.1 if change == "penalty" else 0.0)
    assert not hasattr(model.a.weight, extension.attr)


@pytest.mark.parametrize(
    "extension", [ext.BatchGrad, ext.BatchL2Grad, ext.SumGradSquared, ext.Variance]
)
def test_a_replayed_first_order_pass_still_sees_a_term_from_outside_the_loss(extension):
    """A penalty on a parameter (gradient that no module call saw) on a pass of a structure
    cached and checked twice: the sum check of that pass raises, and nothing is written; the
    next clean pass writes what the first pass wrote."""
    model, lossfunc, x, y = _setup()
    first = _pass(model, lossfunc, x, y, extension)
    _pass(model, lossfunc, x, y, extension)
    _forget(model, extension.attr)
    model.zero_grad(set_to_none=True)
    out = model(x)
    with pytest.raises(UnsupportedModuleError, match="receives gradient from outside"):
        with curvopt.collect(extension()):
            (lossfunc(out, y) + 1e-3 * model.a.weight.square().sum()).backward()
    assert not hasattr(model.a.weight, extension.attr)
    again = _pass(model, lossfunc, x, y, extension)
    for name in first:
        assert torch.equal(_flat(first[name]), _flat(again[name])), name


def _flat(value):
    return value if isinstance(value, torch.Tensor) else torch.cat([f.flatten() for f in value])


def test_a_replayed_pass_spot_checks_a_large_parameter(monkeypatch):
    """A weight with more entries than the spot check reads (600 x 10: spread runs of them):
    per-sample gradients off by 0.1% on a pass of a structure cached and checked still raise."""
    torch.manual_seed(0)
    model = curvopt.extend(nn.Sequential(nn.Linear(600, 10)).to(DT))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    x, y = torch.randn(8, 600, dtype=DT), torch.randint(10, (8,))
    first = _pass(model, lossfunc, x, y, ext.BatchGrad)
    _pass(model, lossfunc, x, y, ext.BatchGrad)
    right = LinearRule.batch_grad

    def wrong(self, call, name, out=None):
        g = right(self, call, name, out)
        return g.mul_(1.001) if name == "weight" else g

    monkeypatch.setattr(LinearRule, "batch_grad", wrong)
    _forget(model, ext.BatchGrad.attr)
    with pytest.raises(UnsupportedModuleError, match="0.weight"):
        _pass(model, lossfunc, x, y, ext.BatchGrad)
    assert not hasattr(model[0].weight, ext.BatchGrad.attr)
    monkeypatch.setattr(LinearRule, "batch_grad", right)
    again = _pass(model, lossfunc, x, y, ext.BatchGrad)
    assert all(torch.equal(first[name], again[name]) for name in first)


_SPOT_TARGETS = ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias", "6.bias"]


@pytest.mark.parametrize("stack_entries", [None, 8 * 10])
@pytest.mark.parametrize("target", _SPOT_TARGETS)
def test_the_spot_check_of_all_parameters_at_once_finds_each_wrong_one(
    target, stack_entries, monkeypatch
):
    """The spot check stacks the parameters of one shape (two 10 x 10 weights, three biases
    of 10) and reads all stacks' comparisons at once (``stack_entries``: stacks of at most 80
    entries, a parameter or a few biases each): one entry of one parameter off by 0.1% of its
    largest per-sample gradient, on a pass of a structure cached and checked, raises and
    names that parameter, whichever it is and wherever it sits in its stack (a 600 x 10
    weight: in the spread runs it reads); the clean passes before and after pass and write
    the same numbers."""
    if stack_entries is not None:
        monkeypatch.setattr(checks, "_STACK_ELEMENTS", stack_entries)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(600, 10), nn.ReLU(), nn.Linear(10, 10), nn.Tanh())
    model = curvopt.extend(model.extend([nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5)]).to(DT))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    x, y = torch.randn(8, 600, dtype=DT), torch.randint(5, (8,))
    first = _pass(model, lossfunc, x, y, ext.BatchGrad)
    _pass(model, lossfunc, x, y, ext.BatchGrad)
    right = LinearRule.batch_grad
    index, name_in_module = target.split(".")

    def wrong(self, call, name, out=None):
        g = right(self, call, name, out)
        if call.module is model[int(index)] and name == name_in_module:
            g[(0,) * g.dim()] += 1e-3 * g.abs().max()
        return g

    monkeypatch.setattr(LinearRule, "batch_grad", wrong)
    _forget(model, ext.BatchGrad.attr)
    with pytest.raises(UnsupportedModuleError, match=f"'{target}'"):
        _pass(model, lossfunc, x, y, ext.BatchGrad)
    assert not any(hasattr(p, ext.BatchGrad.attr) for p in model.parameters())
    monkeypatch.setattr(LinearRule, "batch_grad", right)
    again = _pass(model, lossfunc, x, y, ext.BatchGrad)
    assert all(torch.equal(first[name], again[name]) for name in first)
