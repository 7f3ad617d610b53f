"""Inverting symmetric positive (semi-)definite matrices.

* :func:`cholesky_inverse` -- ``M⁻¹`` through ``M = L Lᵀ``, retried in float64 when the
  factorization fails in lower precision.
* :func:`psd_eigh` -- ``M = Q diag(s) Qᵀ`` with eigenvalues clipped at 0.
"""

from __future__ import annotations

import torch


def _cholesky_inverse(matrix: torch.Tensor) -> tuple[torch.Tensor, bool]:
    factor, info = torch.linalg.cholesky_ex(matrix)
    if bool((info != 0).any()):
        return matrix, False
    return torch.cholesky_inverse(factor), True


def cholesky_inverse(matrix: torch.Tensor) -> torch.Tensor:
    """``M⁻¹`` for a symmetric positive definite ``M`` of shape ``[d, d]``.

    Uses the Cholesky factor ``L`` (``M = L Lᵀ``, ``M⁻¹ = L⁻ᵀ L⁻¹``). If the factorization
    fails in the input's precision (a near-singular ``M`` in float32), it is retried in float64
    and the inverse cast back to the input's dtype. Raises ``torch.linalg.LinAlgError`` when ``M``
    is not positive definite even in float64 (increase the damping).
    """
    inverse, ok = _cholesky_inverse(matrix)
    if ok:
        return inverse
    if matrix.dtype != torch.float64:
        inverse, ok = _cholesky_inverse(matrix.to(torch.float64))
        if ok:
            return inverse.to(matrix.dtype)
    raise torch.linalg.LinAlgError(
        f"cholesky_inverse: the {tuple(matrix.shape)} matrix is not positive definite, even in "
        "float64; increase the damping so that curvature + damping is positive definite"
    )


def psd_eigh(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, Q)`` with ``M = Q diag(s) Qᵀ`` for a symmetric PSD ``M`` of shape ``[d, d]``.

    Eigenvalues below 0 (round-off of a PSD matrix) are clipped to 0; ``s`` has shape ``[d]``,
    ``Q`` is orthogonal ``[d, d]``.
    """
    eigenvalues, eigenvectors = torch.linalg.eigh(matrix)
    return eigenvalues.clamp(min=0), eigenvectors
