"""BatchNorm in training mode: the exact curvature of the loss *as computed*, batch statistics
included (``engine.curvature``, "Coupled passes": ``R K`` exact columns of one row each).

Checked in float64 against ``torch.func`` on the whole-batch function
(``test_batchnorm_expectation``'s problems and reference, ``G = Jᵀ H J`` dense):

* ``diag_ggn_exact`` against ``diag(G)`` (every parameter), also with the columns in chunks;
* ``kflr`` of a weight between BatchNorms: the output side against its coupled definition
  ``Σ_n Σ_p (∂f/∂z_np)ᵀ H (∂f/∂z_np)``, the input side against ``mean_{n,p} x xᵀ``; every
  one-dimensional parameter's ``kflr`` block against its exact GGN block;
* ``EKFAC(factors="kflr")``: ``S`` against ``diag(Qᵀ G Q)`` in its own bases;
* the Monte-Carlo ``KFAC`` of many draws approaches ``KFLR`` (several seeds);
* timm's ``BatchNormAct2d``: as ``BatchNorm2d`` then its activation;
* ``optim.DiagGGNNewton(curvature="exact")`` and ``optim.KFAC(curvature="kflr")``: one step
  equals the damped Newton step with the dense references.
"""

from __future__ import annotations

import pytest
import torch
from test_batchnorm_expectation import CASES, _problem, _pure, _reference
from test_ekfac_coupled import _expected
from timm_loader import timm_or_skip

import curvopt
import curvopt.engine.curvature
from curvopt import extensions as ext

DT = torch.float64


def _close(actual, expected, scale, what):
    torch.testing.assert_close(actual, expected, rtol=1e-9, atol=1e-11 * scale, msg=what)


def _setup(kind, loss, reduction, n):
    """The problem with its first ``n`` samples, its dense reference, the model in train mode."""
    model, X, y, lossfunc, layer, before, after = _problem(kind, loss, reduction)
    X, y = X[:n], y[:n]
    reference = _reference(_pure(model), X, y, lossfunc, layer, before, after)
    return model.train(), X, y, lossfunc, layer, reference


def _collect(model, X, y, lossfunc, *extensions):
    model, lossfunc = curvopt.extend(model), curvopt.extend(lossfunc)
    model.zero_grad()
    loss = lossfunc(model(X), y)
    with curvopt.collect(*extensions):
        loss.backward()
    return dict(model.named_parameters())


@pytest.mark.parametrize("n", [3, 5])
@pytest.mark.parametrize("kind,loss,reduction", CASES)
def test_exact_curvature_is_that_of_the_batch(kind, loss, reduction, n):
    model, X, y, lossfunc, layer, (G, index, B_ref, A_ref) = _setup(kind, loss, reduction, n)
    params = _collect(model, X, y, lossfunc, ext.DiagGGNExact(), ext.KFLR())
    scale = float(torch.diagonal(G).max())
    for name, p in params.items():
        s = index[name]
        _close(p.diag_ggn_exact.flatten(), torch.diagonal(G)[s], scale, f"diag of {name}")
        if p.dim() == 1:
            _close(p.kflr[0], G[s, s], scale, f"kflr block of {name}")
    B, A = params[f"{layer}.weight"].kflr
    _close(B, B_ref, float(B_ref.diagonal().max()), f"kflr B of {layer}")
    torch.testing.assert_close(A, A_ref, rtol=1e-10, atol=1e-12)


def test_columns_in_chunks_give_the_same_curvature(monkeypatch):
    """A column budget of one column per chunk (``LossColumns.fit``): the same values."""
    model, X, y, lossfunc, layer, (G, index, B_ref, _) = _setup("cnn", "ce", "mean", 4)
    monkeypatch.setattr(curvopt.engine.curvature, "_COLUMN_BUDGET", 1)
    params = _collect(model, X, y, lossfunc, ext.DiagGGNExact(), ext.KFLR())
    scale = float(torch.diagonal(G).max())
    diag = torch.cat([p.diag_ggn_exact.flatten() for p in params.values()])
    _close(diag, torch.diagonal(G), scale, "chunked diagonal")
    _close(params[f"{layer}.weight"].kflr[0], B_ref, float(B_ref.diagonal().max()), "chunked B")


@pytest.mark.parametrize("kind,loss", [("mlp", "ce"), ("cnn", "mse")])
def test_ekfac_of_exact_factors_is_the_ggn_in_its_bases(kind, loss):
    model, X, y, lossfunc, _, (G, index, *_) = _setup(kind, loss, "mean", 5)
    params = _collect(model, X, y, lossfunc, ext.EKFAC(factors="kflr"), ext.KFLR())
    scale = float(torch.diagonal(G).max())
    for name, p in params.items():
        S, *bases = p.ekfac
        _close(S, _expected(G, index, name, bases), scale, f"EKFAC S of {name}")
        factors = [Q @ torch.diag(e) @ Q.T for Q, e in zip(bases, _spectra(p.kflr))]
        for f, kflr in zip(factors, p.kflr):  # the bases are the factors' eigenvectors
            _close(f, kflr, float(kflr.diagonal().max()), f"EKFAC bases of {name}")


def _spectra(factors):
    return [torch.linalg.eigvalsh(f) for f in factors]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_monte_carlo_kfac_approaches_kflr(seed):
    """``KFAC``'s coupled Monte-Carlo factors average to ``KFLR``'s: 4000 columns in one pass;
    the output sides within 10% (Frobenius; measured 1.7% to 4.2% over six seeds), the input
    sides equal."""
    model, X, y, lossfunc, layer, _ = _setup("mlp", "ce", "mean", 6)
    exact = _collect(model, X, y, lossfunc, ext.KFLR())
    exact = {k: [f.clone() for f in p.kflr] for k, p in exact.items()}
    torch.manual_seed(seed)
    sampled = _collect(model, X, y, lossfunc, ext.KFAC(mc_samples=4000))
    for name, p in sampled.items():
        gap = torch.linalg.matrix_norm(p.kfac[0] - exact[name][0])
        assert gap < 0.1 * torch.linalg.matrix_norm(exact[name][0]) + 1e-12, name
        if len(p.kfac) == 2:
            torch.testing.assert_close(p.kfac[1], exact[name][1])


def _one_step(opt, model, X, y, lossfunc):
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    opt.zero_grad()
    lossfunc(model(X), y).backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    opt.step()
    steps = {k: p.detach() - before[k] for k, p in model.named_parameters()}
    return grads, steps


def test_diag_ggn_newton_exact_steps_with_the_batch_diagonal():
    model, X, y, lossfunc, _, (G, index, *_) = _setup("cnn", "ce", "mean", 5)
    model = curvopt.extend(model)
    lr, damping = 0.5, 1e-2
    opt = curvopt.optim.DiagGGNNewton(
        model.parameters(), lr=lr, damping=damping, curvature="exact", kl_clip=None
    )
    grads, steps = _one_step(opt, model, X, y, lossfunc)
    for name, step in steps.items():
        d = torch.diagonal(G)[index[name]].view_as(step)
        expected = -lr * grads[name] / (d + damping)
        torch.testing.assert_close(step, expected, rtol=1e-9, atol=1e-12, msg=name)


def test_kfac_kflr_steps_with_the_coupled_factors():
    """``(B ⊗ A + λ I)⁻¹ g`` (``kronecker_damping="exact"``) with ``B`` and ``A`` the dense
    references of the weight between the BatchNorms, the exact GGN block for 1-D parameters."""
    model, X, y, lossfunc, layer, (G, index, B_ref, A_ref) = _setup("mlp", "mse", "mean", 5)
    model = curvopt.extend(model)
    lr, damping = 0.5, 1e-2
    opt = curvopt.optim.KFAC(
        model.parameters(),
        lr=lr,
        damping=damping,
        curvature="kflr",
        kl_clip=None,
        kronecker_damping="exact",
    )
    grads, steps = _one_step(opt, model, X, y, lossfunc)
    weight, kron = f"{layer}.weight", torch.kron(B_ref.contiguous(), A_ref.contiguous())
    for name in (weight, *(k for k, s in steps.items() if s.dim() == 1)):
        s = index[name]
        curvature = kron if name == weight else G[s, s]
        eye = torch.eye(curvature.shape[0], dtype=DT)
        expected = -lr * torch.linalg.solve(curvature + damping * eye, grads[name].flatten())
        torch.testing.assert_close(steps[name].flatten(), expected, rtol=1e-8, atol=1e-12)


def test_timm_batchnorm_act_is_batchnorm_then_its_activation():
    """timm's ``BatchNormAct2d`` in training mode: the exact curvature equals that of the same
    network written as ``BatchNorm2d`` then ``ReLU`` (checked against ``G`` above)."""
    layers = timm_or_skip().layers
    torch.manual_seed(0)
    fused = torch.nn.Sequential(
        torch.nn.Conv2d(2, 3, 3, padding=1), layers.BatchNormAct2d(3, act_layer=torch.nn.ReLU),
        torch.nn.Flatten(), torch.nn.Linear(48, 3),
    ).to(DT)  # fmt: skip
    fused[1].weight.data.uniform_(0.5, 1.5)
    fused[1].bias.data.normal_(0, 0.3)
    plain = torch.nn.Sequential(
        fused[0], torch.nn.BatchNorm2d(3), torch.nn.ReLU(), fused[2], fused[3]
    ).to(DT)
    plain[1].load_state_dict(fused[1].state_dict(), strict=False)
    X, y = torch.randn(5, 2, 4, 4, dtype=DT), torch.randint(0, 3, (5,))
    values = []
    for model in (fused, plain):
        lossfunc = torch.nn.CrossEntropyLoss()
        params = _collect(model, X, y, lossfunc, ext.DiagGGNExact(), ext.KFLR())
        values.append([t.clone() for p in params.values() for t in (p.diag_ggn_exact, *p.kflr)])
    assert len(values[0]) == len(values[1]) == 14  # weights 3 each (diagonal, B, A), 1-D ones 2
    for a, b in zip(*values):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("loss", ["ce", "mse"])
def test_kflr_of_the_first_samples_is_their_share_of_the_coupled_factors(loss, reduction):
    """``KFLR(samples=K)`` before a BatchNorm in training mode: the factors of the layer's first
    ``K`` rows, ``B_K = (N/K) Σ_{m<K} (∂f/∂z_m)ᵀ H (∂f/∂z_m)`` (every loss row's columns, ``f``
    the whole batch's outputs, ``H`` the loss's Hessian with its ``1/N``) and
    ``A_K = mean_{m<K} x_m x_mᵀ``; with ``K = N`` the whole batch's."""
    torch.manual_seed(0)
    first = torch.nn.Linear(3, 4).to(DT)
    norm, head = torch.nn.BatchNorm1d(4).to(DT), torch.nn.Linear(4, 3).to(DT)
    model = torch.nn.Sequential(first, norm, torch.nn.Tanh(), head).train()
    lossfunc = (torch.nn.CrossEntropyLoss if loss == "ce" else torch.nn.MSELoss)(
        reduction=reduction
    )
    n = 6
    X = torch.randn(n, 3, dtype=DT)
    y = torch.randint(0, 3, (n,)) if loss == "ce" else torch.randn(n, 3, dtype=DT)

    def rest(z):  # the outputs as a function of the layer's output (batch statistics)
        h = torch.nn.functional.batch_norm(z, None, None, norm.weight, norm.bias, True)
        return head(torch.tanh(h))

    z = first(X).detach()
    jacobian = torch.func.jacrev(rest)(z)  # [N, C, N, out]
    logits = rest(z).detach()
    hessian = torch.func.hessian(lambda f: lossfunc(f, y))(logits)  # [N, C, N, C]
    for k in (2, n):
        rows = range(k)
        output_side = sum(
            torch.einsum("ica,icjd,jdb->ab", jacobian[:, :, m], hessian, jacobian[:, :, m])
            for m in rows
        ) * (n / k)
        input_side = X[:k].T @ X[:k] / k
        _collect(model, X, y, lossfunc, ext.KFLR(samples=k))
        output_side = output_side.detach()
        scale = float(output_side.abs().max())
        _close(first.weight.kflr[0], output_side, scale, f"B of {k} samples")
        _close(first.weight.kflr[1], input_side, float(input_side.abs().max()), f"A of {k}")
