"""The exact damping of a Kronecker block, ``(B ⊗ A + λ I)⁻¹`` from the eigendecompositions of
both factors (``KFAC(kronecker_damping="exact")``), and the Kronecker products ``B G Aᵀ``;
factors and matrices as in :mod:`curvopt.optim.kronecker`."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from curvopt.engine.psd import psd_eigh
from curvopt.optim.factor_inverse import Factors


def kron_matmul(factors: Factors, matrix: torch.Tensor) -> torch.Tensor:
    """``(B ⊗ A) vec(G)`` as the matrix ``B G Aᵀ`` (``B G`` for ``[B]``); ``G``: ``[dim B, ·]``."""
    result = factors[0] @ matrix
    if len(factors) == 2:
        result = result @ factors[1].mT
    return result


def kron_quadratic(factors: Factors, matrix: torch.Tensor) -> torch.Tensor:
    """``vec(S)ᵀ (B ⊗ A) vec(S) = Σ S ⊙ (B S Aᵀ)``, a scalar tensor."""
    return (matrix * kron_matmul(factors, matrix)).sum()


def kron_eigh(factors: Factors) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``[(s_B, Q_B), (s_A, Q_A)]``: eigendecompositions of the factors (see ``psd_eigh``)."""
    return [psd_eigh(f) for f in factors]


def exact_damped_solve(
    eigs: Sequence[tuple[torch.Tensor, torch.Tensor]], matrix: torch.Tensor, damping: float
) -> torch.Tensor:
    """``(B ⊗ A + λ I)⁻¹ vec(G)`` as a matrix, from ``eigs = kron_eigh([B, A])``::

        Q_B [(Q_Bᵀ G Q_A) / (s_B s_Aᵀ + λ)] Q_Aᵀ

    (``Q_B [(Q_Bᵀ G) / (s_B + λ)]`` for ``[B]``), computed in the eigenvectors' precision and
    returned in ``matrix``'s dtype.
    """
    values = [s for s, _ in eigs]
    vectors = [q for _, q in eigs]
    spectrum = values[0][:, None] * (values[1][None, :] if len(eigs) == 2 else 1)
    rotated = kron_matmul([q.mT for q in vectors], matrix.to(vectors[0].dtype))
    return kron_matmul(vectors, rotated / (spectrum + damping)).to(matrix.dtype)
