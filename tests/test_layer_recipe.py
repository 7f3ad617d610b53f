"""The recipe "add a layer type" of docs/extending.md, followed with a toy layer: a module
and its rule, defined in this one file and registered through the public registry, give
BatchGrad, DiagGGNExact (and its per-sample terms), KFLR (both weight-sharing approximations)
and DiagHessian that match the dense references, with no edit anywhere in curvopt."""

import copy

import pytest
import torch
from conftest import DT, ggn_reference, hessian_reference, per_sample_grads_loop
from reference import kronecker
from torch import nn

import curvopt
from curvopt import extensions as ext
from curvopt.layers import LayerRule, register, rule_for
from curvopt.layers.kron import input_factor, output_factor


class ToyLinear(nn.Module):
    """``x [N, *, I] -> x Wᵀ + b`` written with ``einsum``: not an ``nn.Linear``."""

    def __init__(self, inputs: int, outputs: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(outputs, inputs, dtype=DT))
        self.bias = nn.Parameter(torch.randn(outputs, dtype=DT))

    def forward(self, x):
        return torch.einsum("...i,oi->...o", x, self.weight) + self.bias


def _canonical(call, n):
    """Inputs and output gradients as ``[N, T, features]`` (the positions flattened)."""
    x, g = call.input, call.grad_out
    return x.reshape(n, -1, x.shape[-1]), g.reshape(n, -1, g.shape[-1])


@register(ToyLinear)
class ToyLinearRule(LayerRule):
    """The recipe's one class: per-sample gradients, Kronecker factors in the canonical
    weight-sharing format, and ``curvature_free`` (the output is linear in the input)."""

    curvature_free = True

    def batch_grad(self, call, name, out=None):
        x, g = _canonical(call, call.grad_out.shape[0])
        return g.sum(1) if name == "bias" else torch.einsum("nto,nti->noi", g, x)

    def kron_output_factor(self, call, columns, name, approx, n):
        if name == "bias":
            return None  # one-dimensional: the exact block
        return output_factor(columns.reshape(columns.shape[0], n, -1, columns.shape[-1]), approx)

    def kron_input_factor(self, call, name, approx, n):
        return input_factor(call.input.reshape(n, -1, call.input.shape[-1]), approx)


def _mlp():
    return nn.Sequential(ToyLinear(5, 4), nn.Tanh(), nn.Linear(4, 3))


def _sequence():
    """The toy layer shared over 2 positions of each sample."""
    return nn.Sequential(ToyLinear(5, 4), nn.Sigmoid(), nn.Flatten(), nn.Linear(8, 3))


CASES = {
    "mlp": (_mlp, (6, 5)),
    "sequence": (_sequence, (6, 2, 5)),
}


def _problem(case, reduction):
    torch.manual_seed(0)
    build, shape = CASES[case]
    plain = build().to(DT)
    model = curvopt.extend(copy.deepcopy(plain))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss(reduction=reduction))
    X = torch.randn(*shape, dtype=DT)
    y = torch.randint(0, 3, (shape[0],))
    return plain, model, lossfunc, X, y


def _run(model, lossfunc, X, y, *extensions):
    loss = lossfunc(model(X), y)
    with curvopt.collect(*extensions):
        loss.backward()


def _close(actual, expected, what):
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=1e-7, atol=1e-10 * scale + 1e-13, msg=what)


def test_the_rule_is_registered():
    assert type(rule_for(ToyLinear(2, 2))) is ToyLinearRule


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_first_order_and_ggn_diagonal(case, reduction):
    plain, model, lossfunc, X, y = _problem(case, reduction)
    _run(model, lossfunc, X, y, ext.BatchGrad(), ext.DiagGGNExact(), ext.BatchDiagGGNExact())
    grads = per_sample_grads_loop(plain, nn.CrossEntropyLoss(reduction=reduction), X, y)
    blocks, per_sample = ggn_reference(plain, nn.CrossEntropyLoss(reduction=reduction), X, y)
    for name, p in model.named_parameters():
        _close(p.grad_batch, grads[name], f"{name} grad_batch")
        _close(p.diag_ggn_exact, torch.diagonal(blocks[name]).reshape(p.shape), f"{name} diag")
        _close(p.diag_ggn_exact_batch, per_sample[name], f"{name} diag_ggn_exact_batch")


@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_kflr(case, reduction, approx):
    plain, model, lossfunc, X, y = _problem(case, reduction)
    _run(model, lossfunc, X, y, ext.KFLR(kfac_approx=approx))
    loss = nn.CrossEntropyLoss(reduction=reduction)
    factors = kronecker(plain, loss, X, y, approx=approx, types=(ToyLinear, nn.Linear))
    blocks, _ = ggn_reference(plain, loss, X, y)
    toy = model[0]
    b, a = factors["0"]
    _close(toy.weight.kflr[0], b, "B")
    _close(toy.weight.kflr[1], a, "A")
    _close(toy.bias.kflr[0], blocks["0.bias"], "bias block")


def test_kflr_is_the_exact_block_for_one_sample():
    """``N = 1``, no weight sharing: ``kron(B, A)`` is the GGN block itself."""
    plain, model, lossfunc, X, y = _problem("mlp", "mean")
    X, y = X[:1], y[:1]
    _run(model, lossfunc, X, y, ext.KFLR())
    blocks, _ = ggn_reference(plain, nn.CrossEntropyLoss(), X, y)
    _close(torch.kron(*model[0].weight.kflr), blocks["0.weight"], "kron(B, A)")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_diag_hessian(case, reduction):
    """The curvature of the nonlinearity right after the toy layer reaches its parameters."""
    plain, model, lossfunc, X, y = _problem(case, reduction)
    _run(model, lossfunc, X, y, ext.DiagHessian(), ext.BatchDiagHessian())
    diag, per_sample = hessian_reference(plain, nn.CrossEntropyLoss(reduction=reduction), X, y)
    for name, p in model.named_parameters():
        _close(p.diag_h, diag[name], f"{name} diag_h")
        _close(p.diag_h_batch, per_sample[name], f"{name} diag_h_batch")
