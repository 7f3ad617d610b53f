"""``EKFAC(trust_metric=...)``: the metric the trust region ``kl_clip`` measures a step in.

``"ggn"`` (the default under the default damping): ``dᵀ (Q diag(vec K) Qᵀ + λ I) d`` with ``K``
the Kronecker factors' eigenvalue products ``s_B s_Aᵀ`` in the step's basis, checked in float64
against the dense ``vec(D)ᵀ (B ⊗ A + λ I) vec(D)``; ``"correction"`` (the default with a
damping given): ``gᵀd``, in the metric of ``S``.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import curvopt
from curvopt.inversion.eigen_corrected import (
    basis_eigenvalues,
    eigen_corrected_quadratic,
    factor_products,
)
from curvopt.optim import EKFAC
from curvopt.optim.ekfac import trust_metric


def _psd(d: int, generator: torch.Generator) -> torch.Tensor:
    root = torch.randn(d, d + 2, dtype=torch.float64, generator=generator)
    return root @ root.T


def _orthogonal(d: int, generator: torch.Generator) -> torch.Tensor:
    square = torch.randn(d, d, dtype=torch.float64, generator=generator)
    return torch.linalg.qr(square)[0].contiguous()


def test_quadratic_in_the_factors_eigenbasis_is_the_dense_kronecker_one():
    """``Σ (K + λ) ⊙ (Q_Bᵀ D Q_A)²`` with ``K = s_B s_Aᵀ`` from the factors' eigenbases equals
    ``vec(D)ᵀ (Q_B diag(s_B) Q_Bᵀ ⊗ Q_A diag(s_A) Q_Aᵀ + λ I) vec(D)`` (row-major ``vec``)."""
    generator = torch.Generator().manual_seed(0)
    B, A = _psd(3, generator), _psd(5, generator)
    bases = [torch.linalg.eigh(B)[1], torch.linalg.eigh(A)[1]]
    D = torch.randn(3, 5, dtype=torch.float64, generator=generator)
    damping = 0.3
    products = factor_products(basis_eigenvalues(bases, [B, A]), torch.Size([3, 5]))
    found = eigen_corrected_quadratic(bases, products + damping, D)
    dense = torch.kron(B, A) + damping * torch.eye(15, dtype=torch.float64)
    expected = D.reshape(-1) @ dense @ D.reshape(-1)
    torch.testing.assert_close(found, expected, rtol=1e-12, atol=0)


def test_eigenvalues_in_another_basis_are_the_diagonal_of_the_kronecker_product_there():
    """In a basis that is not the factors' eigenbasis (a warm refresh's, the identity of a wide
    side) ``K`` is ``diag(Qᵀ (B ⊗ A) Q)``; a side without a basis (``None``) is the identity."""
    generator = torch.Generator().manual_seed(1)
    B, A = _psd(3, generator), _psd(4, generator)
    Q_B, Q_A = (_orthogonal(d, generator) for d in (3, 4))
    products = factor_products(basis_eigenvalues([Q_B, Q_A], [B, A]), torch.Size([3, 4]))
    Q = torch.kron(Q_B, Q_A)
    expected = torch.diagonal(Q.T @ torch.kron(B, A) @ Q).reshape(3, 4)
    torch.testing.assert_close(products, expected, rtol=1e-12, atol=1e-14)
    identity = factor_products(basis_eigenvalues([Q_B, None], [B, A]), torch.Size([3, 4]))
    Q = torch.kron(Q_B, torch.eye(4, dtype=torch.float64))
    expected = torch.diagonal(Q.T @ torch.kron(B, A) @ Q).reshape(3, 4)
    torch.testing.assert_close(identity, expected, rtol=1e-12, atol=1e-14)
    bias = factor_products(basis_eigenvalues([Q_B], [B]), torch.Size([3, 1]))
    torch.testing.assert_close(bias[:, 0], torch.diagonal(Q_B.T @ B @ Q_B), rtol=1e-12, atol=0)


@pytest.mark.parametrize("with_bases", [True, False])
def test_a_grouped_convolutions_stacked_factors_give_one_product_per_group(with_bases):
    """Stacked ``[G, d, d]`` factors (a grouped convolution's blocks), with stacked bases or
    none (the identity): ``K`` in the parameter's order ``[G, d_B, d_A]`` is the diagonal of
    ``Qᵀ (B_g ⊗ A_g) Q`` per group, the dense block-diagonal reference's."""
    generator = torch.Generator().manual_seed(2)
    groups, d_B, d_A = 3, 2, 4
    B = torch.stack([_psd(d_B, generator) for _ in range(groups)])
    A = torch.stack([_psd(d_A, generator) for _ in range(groups)])
    if with_bases:
        Q_B = torch.stack([_orthogonal(d_B, generator) for _ in range(groups)])
        Q_A = torch.stack([_orthogonal(d_A, generator) for _ in range(groups)])
    else:
        Q_B = torch.eye(d_B, dtype=torch.float64).expand(groups, d_B, d_B)
        Q_A = torch.eye(d_A, dtype=torch.float64).expand(groups, d_A, d_A)
    bases = [Q_B, Q_A] if with_bases else [None, None]
    shape = torch.Size([groups, d_B, d_A]) if with_bases else torch.Size([1, groups * d_B * d_A])
    products = factor_products(basis_eigenvalues(bases, [B, A]), shape)
    expected = torch.stack(
        [
            torch.diagonal(
                torch.kron(Q_B[g], Q_A[g]).T @ torch.kron(B[g], A[g]) @ torch.kron(Q_B[g], Q_A[g])
            )
            for g in range(groups)
        ]
    ).reshape(shape)
    torch.testing.assert_close(products, expected, rtol=1e-12, atol=1e-14)


def test_the_default_steps_a_grouped_convolution():
    """``EKFAC`` at its defaults (``trust_metric="ggn"``) steps a network with a depthwise
    convolution (timm's MobileNets and ConvNeXts) and lowers its loss."""
    torch.manual_seed(0)
    model = curvopt.extend(
        nn.Sequential(
            nn.Conv2d(2, 4, 3, padding=1),
            nn.Tanh(),
            nn.Conv2d(4, 4, 3, padding=1, groups=4),
            nn.Tanh(),
            nn.Flatten(),
            nn.Linear(4 * 25, 3),
        ).to(torch.float64)
    )
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(16, 2, 5, 5, dtype=torch.float64, generator=generator)
    y = torch.randint(0, 3, (16,), generator=generator)
    opt = EKFAC(model.parameters(), lr=0.05)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = lossfunc(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert trust_metric(opt.param_groups[0]) == "ggn"
    assert losses[-1] < losses[0], losses


def _layer_and_batch():
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    layer = curvopt.extend(nn.Linear(4, 3).to(torch.float64))
    x = 3 * torch.randn(16, 4, dtype=torch.float64, generator=generator)
    y = torch.randint(0, 3, (16,), generator=generator)
    return layer, curvopt.extend(nn.CrossEntropyLoss()), x, y


DAMPING = 1e-2


def _second_step(lr: float, **options):
    """Step 0 at ``lr = 0`` (so that twins stand at one point), then step 1 at ``lr``: step 0's
    ``KFLR`` factors of the weight and the bias (None where not collected), step 1's gradients
    and its parameter deltas."""
    layer, lossfunc, x, y = _layer_and_batch()
    opt = EKFAC(layer.parameters(), lr=0.0, damping=DAMPING, **options)
    with opt.collect():
        lossfunc(layer(x), y).backward()
    factors = [getattr(p, "kflr", None) for p in (layer.weight, layer.bias)]
    factors = [None if f is None else [t.clone() for t in f] for f in factors]
    opt.step()
    opt.param_groups[0]["lr"] = lr
    before = [p.detach().clone() for p in layer.parameters()]
    opt.zero_grad()
    with opt.collect():
        lossfunc(layer(x), y).backward()
    grads = [p.grad.clone() for p in layer.parameters()]
    opt.step()
    return factors, grads, [b - p.detach() for b, p in zip(before, layer.parameters())]


@pytest.mark.parametrize("lr", [0.5, 5.0])
def test_clipped_step_is_scaled_by_the_dense_kfac_trust_region(lr):
    """Step 1 (in the eigenbasis of step 0's ``KFLR`` factors ``B, A``) of ``trust_metric="ggn"``
    is the twin's unclipped step (``kl_clip=None``) times ``ν = min(1, sqrt(κ / (lr² Σ_p
    vec(D_p)ᵀ (B ⊗ A + λ I) vec(D_p))))``, ``D_p`` the unclipped direction of the weight and
    the bias (``B + λ I`` alone); step 0 is taken at ``lr = 0`` so that both are at one point."""
    kl_clip = 1e-3
    factors, _, clipped = _second_step(lr, curvature="kflr", trust_metric="ggn")
    free_factors, _, free = _second_step(lr, curvature="kflr", kl_clip=None)
    for p, q in zip(factors, free_factors):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    length = 0.0
    for fs, delta in zip(free_factors, free):
        direction = (delta / lr).reshape(-1)
        kron = fs[0] if len(fs) == 1 else torch.kron(fs[0], fs[1])
        metric = kron + DAMPING * torch.eye(len(direction), dtype=torch.float64)
        length += float(direction @ metric @ direction)
    nu = min(1.0, math.sqrt(kl_clip / (lr**2 * length)))
    assert nu < 1.0  # the trust region cuts this step: the test can tell the metrics apart
    for step, full in zip(clipped, free):
        torch.testing.assert_close(step, nu * full, rtol=1e-10, atol=1e-14)


def test_the_metric_follows_the_damping_as_the_curvature_interval_does():
    """``trust_metric=None``: ``"ggn"`` under the default damping, ``"correction"`` (``gᵀd``)
    with a damping given or ``basis_source="current"`` (which collects no factors beside
    ``S``); naming ``"ggn"`` with ``basis_source="current"`` raises, naming the fix."""
    params = [nn.Parameter(torch.zeros(2, 2))]
    assert trust_metric(EKFAC(params, 0.1).param_groups[0]) == "ggn"
    assert trust_metric(EKFAC(params, 0.1, damping=1e-3).param_groups[0]) == "correction"
    named_ggn = EKFAC(params, 0.1, damping=1e-3, trust_metric="ggn").param_groups[0]
    assert trust_metric(named_ggn) == "ggn"
    current = EKFAC(params, 0.1, damping=1e-3, basis_source="current").param_groups[0]
    assert trust_metric(current) == "correction"
    named = EKFAC(params, 0.1, damping=1e-3, trust_metric="correction").param_groups[0]
    assert trust_metric(named) == "correction"
    with pytest.raises(ValueError, match="trust_metric='ggn'.*basis_source='last_refresh'"):
        EKFAC(params, 0.1, basis_source="current", trust_metric="ggn")
    with pytest.raises(ValueError, match="trust_metric"):
        EKFAC(params, 0.1, trust_metric="fisher")


@pytest.mark.parametrize("lr", [0.5, 5.0])
def test_correction_metric_is_the_gradient_product(lr):
    """Step 1 of ``trust_metric="correction"`` is the twin's unclipped step (``kl_clip=None``)
    times ``ν = min(1, sqrt(κ / (lr² Σ_p gᵀd)))``, ``g`` the gradient and ``d`` the unclipped
    direction; step 0 is taken at ``lr = 0`` so that both are at one point."""
    kl_clip = 1e-3
    _, grads, clipped = _second_step(lr, trust_metric="correction")
    _, free_grads, free = _second_step(lr, kl_clip=None)
    for g, h in zip(grads, free_grads):
        torch.testing.assert_close(g, h, rtol=0, atol=0)
    length = sum(float((g * delta / lr).sum()) for g, delta in zip(free_grads, free))
    nu = min(1.0, math.sqrt(kl_clip / (lr**2 * length)))
    assert nu < 1.0  # the trust region cuts this step: the test can tell it from none
    for step, full in zip(clipped, free):
        torch.testing.assert_close(step, nu * full, rtol=1e-10, atol=1e-14)
