"""Hugging Face's transposed linear layer ``Conv1D`` (GPT-2): ``y = x @ W + b``, ``W [in, out]``.

A plain-torch class of the same name and layout stands in for ``transformers.pytorch_utils.Conv1D``
(the rule matches by class name); where ``transformers`` is installed the real class is checked
too. Kronecker factors come as ``[A, B]`` (input side first), so ``kron(*p.kflr)`` is indexed
like ``vec(W)`` row-major and, for one sample and one position, equals the exact GGN block.
"""

from __future__ import annotations

import pytest
import torch
from conftest import (
    DT,
    assert_close,
    check_against_loop,
    extended_copy,
    ggn_reference,
    hessian_reference,
)
from torch import nn

import curvopt
from curvopt import extensions as ext


class Conv1D(nn.Module):
    """The layout of Hugging Face's ``Conv1D``: ``weight [nx, nf]``, ``bias [nf]``."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf, dtype=DT) * 0.5)
        self.bias = nn.Parameter(torch.randn(nf, dtype=DT) * 0.1)

    def forward(self, x):
        out = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight)
        return out.reshape(*x.shape[:-1], self.nf)


def _model(conv=Conv1D):
    torch.manual_seed(0)
    return nn.Sequential(conv(5, 4), nn.Tanh(), conv(3, 5)).to(DT)


def _loss(reduction="mean"):
    ce = nn.CrossEntropyLoss(reduction=reduction)
    return lambda out, y: ce(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _ext_loss(reduction="mean"):
    ce = curvopt.extend(nn.CrossEntropyLoss(reduction=reduction))
    return lambda out, y: ce(out.reshape(-1, out.shape[-1]), y.reshape(-1))


@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_first_order_against_per_sample_loop(t, reduction):
    plain = _model()
    X = torch.randn(4, t, 4, dtype=DT)
    y = torch.randint(0, 3, (4, t))
    model = extended_copy(plain)
    check_against_loop(plain, _loss(reduction), X, y, model=model)
    check_against_loop(plain, _ext_loss(reduction), X, y, model=model)


@pytest.mark.parametrize("t", [1, 3])
def test_diag_ggn_exact_against_jacobians(t):
    plain = _model()
    X = torch.randn(3, t, 4, dtype=DT)
    y = torch.randint(0, 3, (3, t))
    blocks, per_sample = ggn_reference(plain, _loss(), X, y)
    model = extended_copy(plain)
    with curvopt.collect(ext.DiagGGNExact(), ext.BatchDiagGGNExact()):
        _ext_loss()(model(X), y).backward()
    for name, p in model.named_parameters():
        assert_close(p.diag_ggn_exact, torch.diagonal(blocks[name]).reshape(p.shape), name)
        assert_close(p.diag_ggn_exact_batch, per_sample[name], name)


@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_diag_hessian_against_torch_func(t, reduction):
    """Tanh between two Conv1D layers: the residual term of the upstream layer goes through the
    downstream one (linear in its input) and its own weighted squares (transposed to [in, out])."""
    plain = _model()
    X = torch.randn(3, t, 4, dtype=DT)
    y = torch.randint(0, 3, (3, t))
    diag, per_sample = hessian_reference(plain, _loss(reduction), X, y)
    model = extended_copy(plain)
    with curvopt.collect(ext.DiagHessian(), ext.BatchDiagHessian()):
        _ext_loss(reduction)(model(X), y).backward()
    for name, p in model.named_parameters():
        assert_close(p.diag_h, diag[name], name)
        assert_close(p.diag_h_batch, per_sample[name], name)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_kflr_is_the_exact_block_for_one_sample(reduction):
    """N == 1, one position: ``kron(*p.kflr)`` equals the GGN block of ``vec(W)`` (row-major
    ``[in, out]``), so the factor order ``[A, B]`` is the one that indexes like ``vec(p)``."""
    plain = _model()
    X = torch.randn(1, 1, 4, dtype=DT)
    y = torch.randint(0, 3, (1, 1))
    blocks, _ = ggn_reference(plain, _loss(reduction), X, y)
    model = extended_copy(plain)
    with curvopt.collect(ext.KFLR()):
        _ext_loss(reduction)(model(X), y).backward()
    for name, p in model.named_parameters():
        if p.dim() == 2:
            a, b = p.kflr
            assert a.shape == (p.shape[0],) * 2 and b.shape == (p.shape[1],) * 2, name
            swapped = torch.kron(b, a)
            assert not torch.allclose(swapped, blocks[name]), "test cannot tell the order"
        assert_close(torch.kron(*p.kflr) if p.dim() == 2 else p.kflr[0], blocks[name], name)


def test_kflr_matches_the_equivalent_linear():
    """With several samples and positions the factors are those of ``nn.Linear`` on ``Wᵀ``."""
    conv = _model()
    linear = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DT)
    with torch.no_grad():
        for c, lin in ((conv[0], linear[0]), (conv[2], linear[2])):
            lin.weight.copy_(c.weight.T)
            lin.bias.copy_(c.bias)
    X = torch.randn(3, 2, 4, dtype=DT)
    y = torch.randint(0, 3, (3, 2))
    for approx in ("expand", "reduce"):
        for model in (curvopt.extend(conv), curvopt.extend(linear)):
            with curvopt.collect(ext.KFLR(kfac_approx=approx)):
                _ext_loss()(model(X), y).backward()
        for c, lin in ((conv[0], linear[0]), (conv[2], linear[2])):
            assert_close(c.weight.kflr[0], lin.weight.kflr[1], approx)
            assert_close(c.weight.kflr[1], lin.weight.kflr[0], approx)


def test_linalg_kfac_and_optimizer_on_conv1d():
    """linalg.KFAC reads the input-side factor's position from the rule; optim.KFAC steps."""
    model = curvopt.extend(_model())
    ce = curvopt.extend(nn.CrossEntropyLoss())
    X = torch.randn(1, 4, dtype=DT)
    y = torch.randint(0, 3, (1,))
    op = curvopt.linalg.KFAC(model, ce, [(X, y)], curvature="kflr")
    exact = curvopt.linalg.GGN(model, ce, [(X, y)]).to_dense()
    dense = op.to_dense()
    start = 0
    for p in model.parameters():  # the diagonal blocks coincide for one sample
        stop = start + p.numel()
        torch.testing.assert_close(
            torch.as_tensor(dense[start:stop, start:stop]),
            torch.as_tensor(exact[start:stop, start:stop]),
        )
        start = stop
    opt = curvopt.optim.KFAC(model.parameters(), lr=0.1, damping=1e-2, curvature="kflr")
    X = torch.randn(16, 4, dtype=DT)
    y = torch.randint(0, 3, (16,))
    losses = []
    for _ in range(15):
        opt.zero_grad()
        loss = ce(model(X), y)
        with opt.collect():
            loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.7 * losses[0]


def test_a_module_named_conv1d_with_another_layout_is_rejected():
    class Conv1D(nn.Module):  # noqa: N801  (same name, a real 1-D convolution inside)
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(3, 2, 2, dtype=DT))

        def forward(self, x):
            return torch.nn.functional.conv1d(x, self.weight)

    model = curvopt.extend(nn.Sequential(Conv1D()))
    out = model(torch.randn(2, 2, 5, dtype=DT))
    with pytest.raises(curvopt.errors.UnsupportedModuleError, match="Conv1D"):
        with curvopt.collect(ext.BatchGrad()):
            out.sum().backward()


def test_hugging_face_conv1d():
    pytorch_utils = pytest.importorskip("transformers.pytorch_utils")

    def hf(nf, nx):
        layer = pytorch_utils.Conv1D(nf, nx).to(DT)
        nn.init.normal_(layer.weight)
        nn.init.normal_(layer.bias)
        return layer

    plain = _model(hf)
    X = torch.randn(1, 1, 4, dtype=DT)
    y = torch.randint(0, 3, (1, 1))
    check_against_loop(plain, _loss(), X, y)
    blocks, _ = ggn_reference(plain, _loss(), X, y)
    model = extended_copy(plain)
    with curvopt.collect(ext.KFLR()):
        _ext_loss()(model(X), y).backward()
    for name, p in model.named_parameters():
        assert_close(torch.kron(*p.kflr) if p.dim() == 2 else p.kflr[0], blocks[name], name)
