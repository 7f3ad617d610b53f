"""``torch.compile``d models: first-order quantities as on the eager model (float64, exactly),
whether the model is extended before or after compiling, with an extended or a functional
loss; curvature of a model compiled then extended as on the eager model (it runs eagerly
there); of one extended then compiled it raises naming both ways out, and works on the
uncompiled module. The ``aot_eager``
backend builds the same compiled autograd nodes as inductor without a C++ build."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import curvopt
from curvopt import extensions as ext
from curvopt.errors import UnsupportedModuleError
from curvopt.optim import KFAC, VarianceAdaptedSGD

DT = torch.float64
FIRST_ORDER = ("grad_batch", "variance", "batch_l2", "sum_grad_squared")


def _plain():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(DT)


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(6, 3, generator=g, dtype=DT), torch.randint(0, 2, (6,), generator=g)


def _compiled(plain, order):
    """``(the module to call, the module holding the parameters)``."""
    model = copy.deepcopy(plain)
    if order == "extend_then_compile":
        return torch.compile(curvopt.extend(model), backend="aot_eager"), model
    return curvopt.extend(torch.compile(model, backend="aot_eager")), model


def _first_order(call, owner, loss):
    exts = (ext.BatchGrad(), ext.Variance(), ext.BatchL2Grad(), ext.SumGradSquared())
    X, y = _data()
    with curvopt.collect(*exts):
        loss(call(X), y).backward()
    return {a: [getattr(p, a).clone() for p in owner.parameters()] for a in FIRST_ORDER}


LOSSES = {
    "extended": lambda: curvopt.extend(nn.CrossEntropyLoss()),
    "functional": lambda: F.cross_entropy,
}


@pytest.mark.parametrize("loss", list(LOSSES))
@pytest.mark.parametrize("order", ["extend_then_compile", "compile_then_extend"])
def test_first_order_on_a_compiled_model_is_the_eager_one(order, loss):
    plain = _plain()
    eager = curvopt.extend(copy.deepcopy(plain))
    want = _first_order(eager, eager, LOSSES[loss]())
    call, owner = _compiled(plain, order)
    got = _first_order(call, owner, LOSSES[loss]())
    for attr in FIRST_ORDER:
        for g, w in zip(got[attr], want[attr]):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-15)


def _kflr(call, owner):
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    X, y = _data()
    owner.zero_grad()
    with curvopt.collect(ext.KFLR()):
        lossfunc(call(X), y).backward()
    return [[f.clone() for f in p.kflr] for p in owner.parameters()]


def test_curvature_on_a_model_compiled_then_extended_is_the_eager_one():
    """``curvopt.extend(torch.compile(model))``: the compiled model runs eagerly where curvature
    is collected (tests/test_compiled_models.py trains with it)."""
    plain = _plain()
    call, owner = _compiled(plain, "compile_then_extend")
    eager = curvopt.extend(copy.deepcopy(plain))
    for got, want in zip(_kflr(call, owner), _kflr(eager, eager)):
        for f, g in zip(got, want):
            torch.testing.assert_close(f, g, rtol=1e-12, atol=1e-15)


def test_curvature_on_a_model_extended_then_compiled_raises_and_runs_on_the_uncompiled_module():
    plain = _plain()
    call, owner = _compiled(plain, "extend_then_compile")
    with pytest.raises(UnsupportedModuleError, match="_orig_mod") as error:
        _kflr(call, owner)
    assert "curvopt.extend(torch.compile(model))" in str(error.value)
    eager = curvopt.extend(copy.deepcopy(plain))
    for got, want in zip(_kflr(owner, owner), _kflr(eager, eager)):
        for f, g in zip(got, want):
            torch.testing.assert_close(f, g, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("alive", [0, 2])
def test_first_order_optimizer_trains_a_compiled_model_as_the_eager_one(alive):
    """``VarianceAdaptedSGD`` (armed, no block) on a compiled model: the eager steps; KFAC's
    step on it raises in the backward pass. Also with ``alive`` armed optimizers of other
    models in the process (a comparison in one notebook): the forward hook that asks them
    whether they need the loss once failed under dynamo with a ``TypeError``."""
    torch._dynamo.reset()  # traced afresh, whatever earlier tests compiled
    others = [KFAC(curvopt.extend(_plain()).parameters(), 0.1, 0.1) for _ in range(alive)]
    plain = _plain()
    runs = []
    for compiled in (False, True):
        owner = curvopt.extend(copy.deepcopy(plain))
        call = torch.compile(owner, backend="aot_eager") if compiled else owner
        opt = VarianceAdaptedSGD(owner.parameters(), lr=0.1)
        X, y = _data()
        for _ in range(2):
            opt.zero_grad()
            F.cross_entropy(call(X), y).backward()
            opt.step()
        runs.append(torch.cat([p.detach().reshape(-1) for p in owner.parameters()]))
    torch.testing.assert_close(runs[1], runs[0], rtol=1e-12, atol=1e-15)
    owner = curvopt.extend(copy.deepcopy(plain))
    armed = KFAC(owner.parameters(), lr=0.1, damping=0.1)  # collects from the next backward
    call = torch.compile(owner, backend="aot_eager")
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    X, y = _data()
    with pytest.raises(UnsupportedModuleError, match="torch.compile"):
        lossfunc(call(X), y).backward()
    assert armed.collect().extensions  # it was armed for KFAC
    assert all(other.collect().extensions for other in others)  # and they were, all along
