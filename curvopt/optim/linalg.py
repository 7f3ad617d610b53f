"""Factorising and inverting symmetric positive (semi-)definite matrices.

* :func:`working_dtype` -- the precision factorisations run in: float32 at least.
* :func:`cholesky_factor` -- ``L`` with ``M = L Lᵀ``, retried in float64 when the factorization
  fails in lower precision.
* :func:`cholesky_solve_right` -- ``X M⁻¹`` from ``L`` by two triangular solves.
* :func:`cholesky_inverse` -- ``M⁻¹`` through ``M = L Lᵀ``.
* :func:`psd_eigh` -- ``M = Q diag(s) Qᵀ`` with eigenvalues clipped at 0.
"""

from __future__ import annotations

from typing import Callable

import torch


def working_dtype(dtype: torch.dtype) -> torch.dtype:
    """``dtype``, or float32 for floating types of less precision (bfloat16, float16): torch
    cannot factorise in those on CPU, and their 8 or 11 bits cannot resolve a damping."""
    if dtype.is_floating_point and torch.finfo(dtype).bits < 32:
        return torch.float32
    return dtype


def _cholesky(
    matrix: torch.Tensor, in_float64: Callable[[], torch.Tensor] | None = None
) -> torch.Tensor:
    """``L`` of ``M``, in float64 when the input's precision fails (raises if that fails);
    ``in_float64()`` gives ``M`` computed in float64 for the retry (default: ``M`` cast)."""
    factor, info = torch.linalg.cholesky_ex(matrix)
    if bool((info != 0).any()) and matrix.dtype != torch.float64:
        exact = matrix.to(torch.float64) if in_float64 is None else in_float64()
        factor, info = torch.linalg.cholesky_ex(exact)
    if bool((info != 0).any()):
        raise torch.linalg.LinAlgError(
            f"cholesky: the {tuple(matrix.shape)} matrix is not positive definite, even in "
            "float64; increase the damping so that curvature + damping is positive definite"
        )
    return factor


def cholesky_factor(
    matrix: torch.Tensor, in_float64: Callable[[], torch.Tensor] | None = None
) -> torch.Tensor:
    """The lower-triangular ``L`` with ``M = L Lᵀ`` for a symmetric positive definite ``[d, d]``.

    Factorised in :func:`working_dtype` (``M`` in bfloat16/float16 is promoted to float32, and
    ``L`` returned in float32). If the factorization fails in that precision (a near-singular
    ``M`` in float32), it is retried in float64 (on ``in_float64()`` if given: ``M`` recomputed
    from float64 inputs, else ``M`` cast) and ``L`` cast back. Raises
    ``torch.linalg.LinAlgError`` when ``M`` is not positive definite even in float64.
    """
    dtype = working_dtype(matrix.dtype)
    return _cholesky(matrix.to(dtype), in_float64).to(dtype)


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

    As :func:`cholesky_factor` (float32 at least), a failed factorization is retried in float64
    (the inverse is computed there and cast back); ``torch.linalg.LinAlgError`` if ``M`` is not
    positive definite even then.
    """
    dtype = working_dtype(matrix.dtype)
    return torch.cholesky_inverse(_cholesky(matrix.to(dtype))).to(dtype)


def psd_eigh(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, Q)`` with ``M = Q diag(s) Qᵀ`` for a symmetric PSD ``M`` of shape ``[d, d]``.

    Eigenvalues below 0 (round-off of a PSD matrix) are clipped to 0; ``s`` has shape ``[d]``,
    ``Q`` is orthogonal ``[d, d]``; both in :func:`working_dtype`.

    Zero rows (a zero diagonal entry of a PSD matrix: an input feature that is always 0, such
    as MNIST's border pixels) are deflated exactly: their unit vectors with eigenvalue 0 come
    first, then the eigenpairs of the remaining block. LAPACK's solver returned NaN without
    raising, and failed to converge in float64, on MNIST logreg's input factor (784 x 784, 286
    zero rows); a non-finite float32 result is also recomputed in float64 and cast back.
    Raises ``torch.linalg.LinAlgError`` for a non-finite ``M``.
    """
    dtype = working_dtype(matrix.dtype)
    matrix = matrix.to(dtype)
    if not bool(matrix.isfinite().all()):
        raise torch.linalg.LinAlgError(
            f"psd_eigh: the {tuple(matrix.shape)} matrix has non-finite entries"
        )
    active = matrix.diagonal() != 0
    if bool(active.all()):
        return _finite_eigh(matrix)
    kept = active.nonzero().squeeze(1)
    values, block = _finite_eigh(matrix[kept][:, kept])
    dropped = (~active).nonzero().squeeze(1)
    eigenvalues = torch.cat([values.new_zeros(len(dropped)), values])
    eigenvectors = matrix.new_zeros(matrix.shape)
    eigenvectors[dropped, torch.arange(len(dropped), device=matrix.device)] = 1
    eigenvectors[kept[:, None], len(dropped) + torch.arange(len(kept), device=matrix.device)] = (
        block
    )
    return eigenvalues, eigenvectors


def _finite_eigh(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.linalg.eigh`` with eigenvalues clipped at 0, recomputed in float64 (and cast
    back) when the float32 solve returns non-finite numbers."""
    eigenvalues, eigenvectors = torch.linalg.eigh(matrix)
    if not bool(eigenvalues.isfinite().all() & eigenvectors.isfinite().all()):
        eigenvalues, eigenvectors = (t.to(matrix.dtype) for t in torch.linalg.eigh(matrix.double()))
    return eigenvalues.clamp(min=0), eigenvectors
