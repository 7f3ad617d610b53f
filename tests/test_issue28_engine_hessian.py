"""``DiagHessian`` through in-place ops on views (autograd's ``CopySlices``: ``relu_``,
``nn.ReLU(inplace=True)``, ``h += o``, ``h *= 2; h.add_(x)``, ``tanh_`` on a slice or after a
residual add), whose curvature is that of their out-of-place forms, against the diagonal of
``torch.func``'s Hessian (reverse over reverse) in float64; and the ops that must still raise.

A ``Linear`` on ``[N, T, D]`` returns a view of its ``[N T, D']`` product, so every in-place op on
its output goes through ``CopySlices``."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev

import curvopt
from curvopt import extensions as ext
from curvopt.errors import UnsupportedModuleError

DT = torch.float64
N, T, C = 3, 2, 3


def _relu_(h, o, m):
    return m.l2(o).relu_()


def _relu_module(h, o, m):
    return m.act(m.l2(o))


def _add_(h, o, m):
    h = m.l2(o)
    h += o
    return h


def _mul_then_add_(h, o, m):
    h = m.l2(o)
    h *= 2
    h.add_(o)
    return h


def _tanh_after_residual(h, o, m):
    h = m.l2(o)
    h += o
    return h.tanh_()


def _tanh_on_slice(h, o, m):
    h = m.l2(o)
    h[:, 0].tanh_()
    return h


def _sigmoid_of_view(h, o, m):
    return m.l2(o).view(-1, 4).sigmoid_().view(o.shape)


OPS = {
    "relu_": _relu_,
    "ReLU(inplace=True)": _relu_module,
    "h += o": _add_,
    "h *= 2; h.add_(o)": _mul_then_add_,
    "tanh_ after h += o": _tanh_after_residual,
    "h[:, 0].tanh_()": _tanh_on_slice,
    "view(...).sigmoid_()": _sigmoid_of_view,
}


class Model(nn.Module):
    """``[N, T, 3]`` → Linear → tanh → Linear, the in-place op, Linear: logits ``[N, T, C]``."""

    def __init__(self, op):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, C)
        self.act = nn.ReLU(inplace=True)
        self.op = op

    def forward(self, x):
        h = self.l1(x)
        return self.l3(self.op(h, torch.tanh(h), self))


def _problem(op, reduction):
    torch.manual_seed(0)
    model = Model(op).to(DT)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, T, 3, generator=g, dtype=DT)
    y = torch.randint(0, C, (N * T,), generator=g)
    lossfunc = nn.CrossEntropyLoss(reduction=reduction)
    return model, lossfunc, x, y


def _reference_diagonals(model, lossfunc, x, y):
    """``{name: diag(∂²L/∂p²)}`` by ``torch.func.jacrev`` over ``jacrev``."""
    params = {k: p.detach() for k, p in model.named_parameters()}
    result = {}
    for k, p in params.items():

        def loss(q, k=k):
            return lossfunc(functional_call(model, {**params, k: q}, (x,)).reshape(-1, C), y)

        h = jacrev(jacrev(loss))(p).reshape(p.numel(), p.numel())
        result[k] = torch.diagonal(h).reshape(p.shape)
    return result


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", list(OPS))
def test_diag_hessian_through_in_place_ops_on_views(name, reduction):
    model, lossfunc, x, y = _problem(OPS[name], reduction)
    expected = _reference_diagonals(model, lossfunc, x, y)
    curvopt.extend(model), curvopt.extend(lossfunc)
    with curvopt.collect(ext.DiagHessian(), ext.BatchDiagHessian()):
        lossfunc(model(x).reshape(-1, C), y).backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.diag_h, expected[k], rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(p.diag_h_batch.sum(0), p.diag_h, rtol=1e-10, atol=1e-13)


def _mul_by_activation(h, o, m):
    h = m.l2(o)
    h.mul_(o)
    return h


def _div_by_activation(h, o, m):
    h = m.l2(o)
    h.div_(o + 2)
    return h


@pytest.mark.parametrize("op", [_mul_by_activation, _div_by_activation])
def test_in_place_ops_with_curvature_between_operands_raise(op):
    """``h *= o`` with ``o`` from the parameters is bilinear: its cross terms are not
    implemented, so the pass raises instead of returning a diagonal without them."""
    model, lossfunc, x, y = _problem(op, "mean")
    curvopt.extend(model), curvopt.extend(lossfunc)
    with pytest.raises(UnsupportedModuleError, match="in-place op on a view"):
        with curvopt.collect(ext.DiagHessian()):
            lossfunc(model(x).reshape(-1, C), y).backward()
    assert not hasattr(model.l1.weight, "diag_h")


class HardsigmoidModel(nn.Module):
    def __init__(self, gate):
        super().__init__()
        self.l1, self.gate, self.l2 = nn.Linear(3, 4), gate, nn.Linear(4, C)

    def forward(self, x):
        return self.l2(self.gate(torch.tanh(self.l1(x)) * 4))


class ClampedHardsigmoid(nn.Module):
    """``hardsigmoid`` from ``clamp``, which torch differentiates twice."""

    def forward(self, x):
        return (x + 3).clamp(0, 6) / 6


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_diag_hessian_with_hardsigmoid_is_that_of_the_piecewise_linear_op(reduction):
    """``nn.Hardsigmoid``'s curvature is zero almost everywhere (inputs in both its flat and
    its linear parts here), against the model with the op written from ``clamp``."""
    torch.manual_seed(0)
    model = HardsigmoidModel(nn.Hardsigmoid()).to(DT)
    reference = HardsigmoidModel(ClampedHardsigmoid()).to(DT)
    reference.load_state_dict(model.state_dict())
    x = torch.randn(N, 3, dtype=DT)
    y = torch.randint(0, C, (N,))
    lossfunc = nn.CrossEntropyLoss(reduction=reduction)
    expected = _reference_diagonals(reference, lossfunc, x, y)
    curvopt.extend(model), curvopt.extend(lossfunc)
    with curvopt.collect(ext.DiagHessian()):
        lossfunc(model(x), y).backward()
    for k, p in model.named_parameters():  # torch's float64 hardsigmoid backward multiplies
        scale = float(expected[k].abs().max())  # by a float32 1/6 (relative error 3e-8)
        torch.testing.assert_close(p.diag_h, expected[k], rtol=1e-5, atol=1e-5 * scale)


def test_verify_with_hardsigmoid_raises_naming_the_op_and_the_fix():
    """torch has no second derivative of ``hardsigmoid``'s backward, so ``verify``'s reference
    cannot be computed: a clear error instead of torch's raw ``NotImplementedError``."""
    torch.manual_seed(0)
    model = curvopt.extend(HardsigmoidModel(nn.Hardsigmoid()).to(DT))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    x, y = torch.randn(N, 3, dtype=DT), torch.randint(0, C, (N,))
    with pytest.raises(UnsupportedModuleError, match=r"hardsigmoid.*clamp\(0, 6\)"):
        curvopt.verify(model, lossfunc, x, y, [ext.DiagHessian()])


class Scale(nn.Module):
    """``x * w``: linear in its input, but without a rule that says so."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, dtype=DT))

    def forward(self, x):
        return x * self.w


def test_diag_hessian_error_for_a_module_without_a_linearity_rule_does_not_call_it_nonlinear():
    torch.manual_seed(0)
    model = curvopt.extend(nn.Sequential(nn.Linear(3, 4), Scale(), nn.Tanh(), nn.Linear(4, C)))
    model = model.to(DT)
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    x, y = torch.randn(N, 3, dtype=DT), torch.randint(0, C, (N,))
    with pytest.raises(UnsupportedModuleError) as error:
        with curvopt.collect(ext.DiagHessian()):
            lossfunc(model(x), y).backward()
    message = str(error.value)
    assert "'1'" in message and "Scale" in message and "curvature_free" in message
    assert "nonlinear in its input" not in message


class _RawParameterProduct(nn.Module):
    """A raw parameter ``w`` (no module of its own) in a product or quotient of the hidden
    layer: ``h w`` is linear in ``w``; ``h / w``, ``h w w`` and ``tanh(h w) w`` are curved in it
    (``∂²/∂w²`` of ``h / w`` is ``2h / w³``)."""

    def __init__(self, op):
        super().__init__()
        self.a, self.b, self.op = nn.Linear(3, 3).to(DT), nn.Linear(3, 2).to(DT), op
        self.w = nn.Parameter(torch.rand(3, dtype=DT) + 1)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(self.op(h, self.w))


_LINEAR_IN_W = {"h * w": lambda h, w: h * w, "w * h": lambda h, w: w * h}
_CURVED_IN_W = {
    "h / w": lambda h, w: h / w,
    "h * w * w": lambda h, w: h * w * w,
    "w * w * h": lambda h, w: (w * w) * h,
    "tanh(h * w) * w": lambda h, w: torch.tanh(h * w) * w,
}


def _hessian_diagonals(model, X, y):
    params = {n: p.detach() for n, p in model.named_parameters()}
    lossfunc = nn.CrossEntropyLoss()
    hess = torch.func.hessian(lambda q: lossfunc(functional_call(model, q, (X,)), y))(params)
    return {n: hess[n][n].reshape(p.numel(), p.numel()).diagonal().reshape(p.shape)
            for n, p in params.items()}


@pytest.mark.parametrize("op", sorted(_LINEAR_IN_W))
def test_a_raw_parameter_in_a_product_has_the_hessian_diagonal(op):
    torch.manual_seed(0)
    model = _RawParameterProduct(_LINEAR_IN_W[op])
    X, y = torch.randn(4, 3, dtype=DT), torch.randint(0, 2, (4,))
    expected = _hessian_diagonals(model, X, y)
    curvopt.extend(model)
    with curvopt.collect(ext.DiagHessian()):
        curvopt.extend(nn.CrossEntropyLoss())(model(X), y).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.diag_h, expected[name], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("op", sorted(_CURVED_IN_W))
def test_a_raw_parameter_curved_in_a_product_or_divisor_raises(op):
    torch.manual_seed(0)
    model = curvopt.extend(_RawParameterProduct(_CURVED_IN_W[op]))
    X, y = torch.randn(4, 3, dtype=DT), torch.randint(0, 2, (4,))
    with pytest.raises(UnsupportedModuleError, match="DiagHessian: the op"):
        with curvopt.collect(ext.DiagHessian()):
            curvopt.extend(nn.CrossEntropyLoss())(model(X), y).backward()
    assert all(not hasattr(p, "diag_h") for p in model.parameters())


class _RawParameterBeforeCurve(nn.Module):
    """A raw parameter ``w`` of the model upstream of a curved op that the model's own call
    encloses (its output is the output of ``b``): ``∂²L/∂w²`` has the term of ``tanh''``,
    which curvopt could only read inside the model's call."""

    def __init__(self, op):
        super().__init__()
        self.a, self.b, self.op = nn.Linear(3, 3).to(DT), nn.Linear(3, 2).to(DT), op
        self.w = nn.Parameter(torch.rand(3, dtype=DT) + 1)

    def forward(self, x):
        return self.b(torch.tanh(self.op(self, x)))


_BEFORE_CURVE = {
    "tanh(x * w)": lambda m, x: x * m.w,
    "tanh(a(x) + w)": lambda m, x: m.a(x) + m.w,
}


@pytest.mark.parametrize("op", sorted(_BEFORE_CURVE))
def test_a_raw_parameter_upstream_of_a_curved_op_in_its_module_raises(op):
    torch.manual_seed(0)
    model = _RawParameterBeforeCurve(_BEFORE_CURVE[op])
    X, y = torch.randn(4, 3, dtype=DT), torch.randint(0, 2, (4,))
    expected = _hessian_diagonals(model, X, y)["w"]
    curvopt.extend(model)
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    with curvopt.collect(ext.DiagGGNExact()):
        lossfunc(model(X), y).backward()
    assert (model.w.diag_ggn_exact - expected).abs().max() > 1e-3  # tanh'' matters for w
    with pytest.raises(UnsupportedModuleError, match=r"parameter 'w' of module '_RawParam"):
        with curvopt.collect(ext.DiagHessian()):
            lossfunc(model(X), y).backward()
    assert all(not hasattr(p, "diag_h") for p in model.parameters())
