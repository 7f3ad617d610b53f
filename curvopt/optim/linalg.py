"""Factorising and inverting symmetric positive (semi-)definite matrices.

* :func:`working_dtype` -- the precision factorisations run in: float32 at least.
* :func:`cholesky_factor` -- ``L`` with ``M = L Lᵀ``, retried in float64 when the factorization
  fails in lower precision.
* :func:`cholesky_solve_right` -- ``X M⁻¹`` from ``L`` by two triangular solves.
* :func:`cholesky_inverse` -- ``M⁻¹`` through ``M = L Lᵀ``.
* :func:`psd_eigh` -- ``M = Q diag(s) Qᵀ`` with eigenvalues clipped at 0 (from
  ``curvopt.engine.psd``, where the engine's ``EKFAC`` eigenbases use it too).
"""

from __future__ import annotations

from typing import Callable

import torch

from curvopt.engine.psd import psd_eigh, working_dtype  # re-exported: optim's factorisations

__all__ = [
    "working_dtype",
    "psd_eigh",
    "cholesky_factor",
    "cholesky_solve_right",
    "cholesky_inverse",
]


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
            "float64; increase the damping so that curvature + damping is positive definite. "
            "If its entries exploded (the steps diverged), keep the optimizer's trust region "
            "on (kl_clip, default 1e-3; kl_clip=None is the unclipped update) or lower lr"
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
