"""Factorising and inverting symmetric positive (semi-)definite matrices.

* :func:`cholesky_factor` -- ``L`` with ``M = L Lᵀ``, retried in float64 when the factorization
  fails in lower precision.
* :func:`cholesky_solve_right` -- ``X M⁻¹`` from ``L`` by two triangular solves.
* :func:`cholesky_inverse` -- ``M⁻¹`` through ``M = L Lᵀ``.
* :func:`psd_eigh` -- ``M = Q diag(s) Qᵀ`` with eigenvalues clipped at 0.
"""

from __future__ import annotations

import torch


def _cholesky(matrix: torch.Tensor) -> torch.Tensor:
    """``L`` of ``M``, in float64 when the input's precision fails (raises if that fails)."""
    factor, info = torch.linalg.cholesky_ex(matrix)
    if bool((info != 0).any()) and matrix.dtype != torch.float64:
        factor, info = torch.linalg.cholesky_ex(matrix.to(torch.float64))
    if bool((info != 0).any()):
        raise torch.linalg.LinAlgError(
            f"cholesky: the {tuple(matrix.shape)} matrix is not positive definite, even in "
            "float64; increase the damping so that curvature + damping is positive definite"
        )
    return factor


def cholesky_factor(matrix: torch.Tensor) -> torch.Tensor:
    """The lower-triangular ``L`` with ``M = L Lᵀ`` for a symmetric positive definite ``[d, d]``.

    If the factorization fails in the input's precision (a near-singular ``M`` in float32), it is
    retried in float64 and ``L`` cast back to the input's dtype. Raises
    ``torch.linalg.LinAlgError`` when ``M`` is not positive definite even in float64.
    """
    return _cholesky(matrix).to(matrix.dtype)


def cholesky_solve_right(matrix: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``X M⁻¹ = X L⁻ᵀ L⁻¹`` for ``X`` of shape ``[m, d]`` and ``L = cholesky_factor(M)``.

    Two triangular solves (``2 m d²`` flops, as many as ``X @ M⁻¹``), no inverse formed.
    """
    return torch.linalg.solve_triangular(
        factor,
        torch.linalg.solve_triangular(factor.mT, matrix, upper=True, left=False),
        upper=False,
        left=False,
    )


def cholesky_inverse(matrix: torch.Tensor) -> torch.Tensor:
    """``M⁻¹ = L⁻ᵀ L⁻¹`` for a symmetric positive definite ``M`` of shape ``[d, d]``.

    As :func:`cholesky_factor`, a failed factorization is retried in float64 (the inverse is
    computed there and cast back); ``torch.linalg.LinAlgError`` if ``M`` is not positive
    definite even then.
    """
    return torch.cholesky_inverse(_cholesky(matrix)).to(matrix.dtype)


def psd_eigh(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, Q)`` with ``M = Q diag(s) Qᵀ`` for a symmetric PSD ``M`` of shape ``[d, d]``.

    Eigenvalues below 0 (round-off of a PSD matrix) are clipped to 0; ``s`` has shape ``[d]``,
    ``Q`` is orthogonal ``[d, d]``.
    """
    eigenvalues, eigenvectors = torch.linalg.eigh(matrix)
    return eigenvalues.clamp(min=0), eigenvectors
