"""The exact damping of a Kronecker block, ``(B ⊗ A + λ I)⁻¹`` from the eigendecompositions of
both factors (``KFAC(kronecker_damping="exact")``), and the Kronecker products ``B G Aᵀ``;
factors and matrices as in :mod:`curvopt.optim.kronecker`."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from curvopt.core.psd import psd_eigh
from curvopt.optim.factor_inverse import Factors


def kron_matmul(factors: Factors, matrix: torch.Tensor) -> torch.Tensor:
    """The Kronecker product ``(B ⊗ A) vec(G)``, as the matrix ``B G Aᵀ`` (``B G`` for ``[B]``).

    ``B ⊗ A`` is never formed; with row-major ``vec`` the result is indexed like ``vec(G)``.

    Args:
        factors: ``[B, A]`` (``B`` ``[m, m]``, ``A`` ``[n, n]``) or ``[B]``.
        matrix: ``G``, ``[m, n]`` (``[m, k]`` for ``[B]``).

    Returns:
        ``B G Aᵀ``, ``[m, n]``.

    Example:
        >>> import torch
        >>> from curvopt import optim
        >>> B, A = torch.diag(torch.tensor([2.0, 4.0])), torch.eye(3)
        >>> G = torch.ones(2, 3)
        >>> optim.kron_matmul([B, A], G)
        tensor([[2., 2., 2.],
                [4., 4., 4.]])
        >>> torch.allclose(torch.kron(B, A) @ G.flatten(), optim.kron_matmul([B, A], G).flatten())
        True
    """
    result = factors[0] @ matrix
    if len(factors) == 2:
        result = result @ factors[1].mT
    return result


def kron_quadratic(factors: Factors, matrix: torch.Tensor) -> torch.Tensor:
    """The quadratic form ``vec(S)ᵀ (B ⊗ A) vec(S) = Σ S ⊙ (B S Aᵀ)``.

    Args:
        factors: ``[B, A]`` or ``[B]``, as for :func:`kron_matmul`.
        matrix: ``S``, ``[dim B, dim A]``.

    Returns:
        A scalar tensor.

    Example:
        >>> import torch
        >>> from curvopt import optim
        >>> B, A = torch.diag(torch.tensor([2.0, 4.0])), torch.eye(3)
        >>> G = torch.ones(2, 3)
        >>> optim.kron_quadratic([B, A], G)
        tensor(18.)
    """
    return (matrix * kron_matmul(factors, matrix)).sum()


def kron_eigh(factors: Factors) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The eigendecompositions ``[(s_B, Q_B), (s_A, Q_A)]`` of PSD Kronecker factors.

    Each is :func:`psd_eigh`'s: eigenvalues clipped at 0, orthogonal ``Q``, ``F = Q diag(s) Qᵀ``.

    Args:
        factors: ``[B, A]`` or ``[B]``, symmetric PSD.

    Returns:
        One ``(s, Q)`` per factor (``s`` ``[d]``, ``Q`` ``[d, d]``).

    Example:
        >>> import torch
        >>> from curvopt import optim
        >>> B, A = torch.diag(torch.tensor([2.0, 4.0])), torch.eye(3)
        >>> G = torch.ones(2, 3)
        >>> [s.tolist() for s, _ in optim.kron_eigh([B, A])]
        [[2.0, 4.0], [1.0, 1.0, 1.0]]
    """
    return [psd_eigh(f) for f in factors]


def exact_damped_solve(
    eigs: Sequence[tuple[torch.Tensor, torch.Tensor]], matrix: torch.Tensor, damping: float
) -> torch.Tensor:
    """The exactly damped Kronecker solve ``(B ⊗ A + λ I)⁻¹ vec(G)``, as a matrix.

    From ``eigs = kron_eigh([B, A])``::

        Q_B [(Q_Bᵀ G Q_A) / (s_B s_Aᵀ + λ)] Q_Aᵀ

    (``Q_B [(Q_Bᵀ G) / (s_B + λ)]`` for ``[B]``): what ``KFAC(kronecker_damping="exact")``
    applies.

    Args:
        eigs: the eigendecompositions of the factors (:func:`kron_eigh`).
        matrix: ``G``, ``[dim B, dim A]``.
        damping: ``λ``.

    Returns:
        The solution as a ``[dim B, dim A]`` matrix, computed in the eigenvectors' precision and
        returned in ``matrix``'s dtype.

    Example:
        >>> import torch
        >>> from curvopt import optim
        >>> B, A = torch.diag(torch.tensor([2.0, 4.0])), torch.eye(3)
        >>> G = torch.ones(2, 3)
        >>> optim.exact_damped_solve(optim.kron_eigh([B, A]), G, damping=2.0)
        tensor([[0.2500, 0.2500, 0.2500],
                [0.1667, 0.1667, 0.1667]])
    """
    values = [s for s, _ in eigs]
    vectors = [q for _, q in eigs]
    spectrum = values[0][:, None] * (values[1][None, :] if len(eigs) == 2 else 1)
    rotated = kron_matmul([q.mT for q in vectors], matrix.to(vectors[0].dtype))
    return kron_matmul(vectors, rotated / (spectrum + damping)).to(matrix.dtype)
