"""Eigenvalue-corrected Kronecker curvature (EKFAC, George et al. 2018).

The Kronecker factors of a parameter give an eigenbasis ``Q = Q_B ⊗ Q_A`` (``B = Q_B diag(s_B)
Q_Bᵀ``, ``A = Q_A diag(s_A) Q_Aᵀ``); instead of KFAC's eigenvalues ``s_B s_Aᵀ`` the curvature
uses the second moment of the per-sample gradients in that basis::

    C = Q diag(vec S) Qᵀ,     S = c · Σ_n (Q_Bᵀ G_n Q_A)²      (element-wise square)

with ``G_n = grad_batch[n].reshape(dim B, -1)`` the per-sample gradient as a matrix (``[dim
B, 1]`` for a bias with ``[B]``; with no factors the basis is the identity and ``G_n`` the
row ``[1, numel]``). ``g_n`` (``grad_batch``) is the gradient of the loss *as computed*
restricted to sample ``n`` (``∇ℓ_n / D`` for ``reduction="mean"``, ``D`` the loss's divisor:
``N`` for one term per sample, ``N T`` counted rows of a flattened sequence loss, ``N K`` for
``MSELoss`` on ``K`` outputs; ``∇ℓ_n`` for ``"sum"``), and the empirical Fisher on the GGN's
scale is ``EF = D Σ_n g_n g_nᵀ`` ("mean") or ``Σ_n g_n g_nᵀ`` ("sum"). Hence ``c = D`` for
"mean", ``c = 1`` for "sum", and::

    vec(S) = diag(Qᵀ EF Q)

exactly: ``C`` is the best approximation of ``EF`` (in Frobenius norm) that is diagonal in the
basis ``Q`` (George et al., Sec. 3). The functions here take the basis as a list of orthogonal
matrices ``bases``: ``[Q_B, Q_A]``, ``[Q_B]`` or ``[]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from curvopt.layers.eigenbasis import as_rows, rotate
from curvopt.core.psd import psd_eigh
from curvopt.core.reductions import dense, diagonal

__all__ = [
    "as_rows",
    "rotate",
    "kron_basis",
    "eigen_corrected_solve",
    "eigen_corrected_coordinates",
    "eigen_corrected_matmul",
    "eigen_corrected_quadratic",
    "basis_eigenvalues",
    "factor_products",
]

Bases = Sequence[torch.Tensor]


def kron_basis(factors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``[Q_B, Q_A]`` (``[Q_B]``): the factors' eigenvectors (``psd_eigh``, float32 at least)."""
    return [psd_eigh(f)[1] for f in factors]


def eigen_corrected_solve(
    bases: Bases, correction: torch.Tensor, matrix: torch.Tensor, damping: float
) -> torch.Tensor:
    """``(Q diag(vec S) Qᵀ + λ I)⁻¹ vec(G)`` as the matrix ``Q_B [(Q_Bᵀ G Q_A) / (S + λ)] Q_Aᵀ``
    (``G`` of shape ``[..., dim B, dim A]``), in ``matrix``'s dtype."""
    rotated = eigen_corrected_coordinates(bases, correction, matrix, damping)
    return rotate(bases, rotated, back=True).to(matrix.dtype)


def eigen_corrected_coordinates(
    bases: Bases, correction: torch.Tensor, matrix: torch.Tensor, damping: float
) -> torch.Tensor:
    """``(Q_Bᵀ G Q_A) / (S + λ)``: the solve of :func:`eigen_corrected_solve` in the basis, the
    coordinates ``Q_Bᵀ D Q_A`` of its direction ``D`` (in ``bases``' dtype), from which a
    quadratic form diagonal in the basis, ``Σ M ⊙ (Q_Bᵀ D Q_A)²``, needs no rotation of ``D``."""
    return rotate(bases, matrix) / (correction + damping)


def eigen_corrected_matmul(
    bases: Bases, correction: torch.Tensor, matrix: torch.Tensor
) -> torch.Tensor:
    """``Q diag(vec S) Qᵀ vec(G)`` as the matrix ``Q_B [(Q_Bᵀ G Q_A) ⊙ S] Q_Aᵀ``."""
    return rotate(bases, rotate(bases, matrix) * correction, back=True).to(matrix.dtype)


def eigen_corrected_quadratic(
    bases: Bases, correction: torch.Tensor, matrix: torch.Tensor
) -> torch.Tensor:
    """``vec(M)ᵀ Q diag(vec S) Qᵀ vec(M) = Σ S ⊙ (Q_Bᵀ M Q_A)²``, a scalar tensor."""
    rotated = rotate(bases, matrix)
    return (correction * rotated * rotated).sum()


def basis_eigenvalues(
    bases: Sequence[torch.Tensor | None],
    factors: Sequence[torch.Tensor],
    powers: Sequence[torch.Tensor | None] | None = None,
) -> list[torch.Tensor]:
    """Per side ``diag(Q_iᵀ F_i Q_i)`` (``[d]``, ``[G, d]`` for stacked ``[G, d, d]``): the
    factor's eigenvalues where ``Q_i`` is its eigenbasis, its diagonal where the side keeps the
    identity (``None``); in the basis' dtype (the factor's without one). ``powers``: per side
    ``F_i Q_i`` in the basis' dtype where formed already (a warm refresh's power step), else
    None (formed here)."""
    powers = [None] * len(factors) if powers is None else powers
    out = []
    for basis, factor, power in zip(bases, factors, powers):
        if basis is None:
            out.append(diagonal(factor))
            continue
        if power is None or power.dtype != basis.dtype:
            power = dense(factor).to(basis.dtype) @ basis
        out.append((power * basis).sum(-2))
    return out


def factor_products(eigenvalues: Sequence[torch.Tensor], shape: torch.Size) -> torch.Tensor:
    """``s_B s_Aᵀ`` (``s_B`` for one side) shaped as the correction ``S`` (``shape``): the
    diagonal of ``Qᵀ (B ⊗ A) Q = diag(Q_Bᵀ B Q_B) ⊗ diag(Q_Aᵀ A Q_A)`` in the basis of ``S``;
    for a grouped convolution's stacked ``[G, d]`` sides, one such product per group, in the
    parameter's order ``[G, d_B, d_A]``."""
    products = eigenvalues[0].unsqueeze(-1)  # [(G,) d_B, 1]
    if len(eigenvalues) == 2:
        products = products * eigenvalues[1].unsqueeze(-2)  # [(G,) 1, d_A]: per group
    return products.reshape(shape)
