"""Eigendecompositions of symmetric positive semi-definite matrices, in a precision that can
resolve them: the eigenbases the engine gives ``EKFAC`` and the factorisations of ``optim``.

* :func:`working_dtype` -- the precision factorisations run in: float32 at least.
* :func:`psd_eigh` -- ``M = Q diag(s) Qᵀ`` with eigenvalues clipped at 0.
"""

from __future__ import annotations

import torch


def working_dtype(dtype: torch.dtype) -> torch.dtype:
    """``dtype``, or float32 for floating types of less precision (bfloat16, float16): torch
    cannot factorise in those on CPU, and their 8 or 11 bits cannot resolve a damping."""
    if dtype.is_floating_point and torch.finfo(dtype).bits < 32:
        return torch.float32
    return dtype


def psd_eigh(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, Q)`` with ``M = Q diag(s) Qᵀ`` for a symmetric PSD ``M`` of shape ``[d, d]``.

    Eigenvalues below 0 (round-off of a PSD matrix) are clipped to 0; ``s`` has shape ``[d]``,
    ``Q`` is orthogonal ``[d, d]``; both in :func:`working_dtype`.

    Zero rows (a zero diagonal entry of a PSD matrix: an input feature that is always 0, such
    as an image's border pixels) are deflated exactly: their unit vectors with eigenvalue 0
    come first, then the eigenpairs of the remaining block (LAPACK's solver can return NaN
    without raising on such matrices); a non-finite float32 result is recomputed in float64
    and cast back.

    Stacked matrices ``[G, d, d]`` (a grouped convolution's per-group factors) give
    ``(s [G, d], Q [G, d, d])``, each as its own (one batched solve where no zero row needs
    deflation).

    Args:
        matrix: the symmetric PSD ``M``, ``[d, d]`` (or ``[G, d, d]``).

    Returns:
        ``(s [d], Q [d, d])``, ascending eigenvalues.

    Raises:
        torch.linalg.LinAlgError: ``M`` has non-finite entries.

    Example:
        >>> import torch
        >>> s, q = psd_eigh(torch.tensor([[2.0, 0.0], [0.0, 0.0]]))
        >>> s
        tensor([0., 2.])
    """
    dtype = working_dtype(matrix.dtype)
    matrix = matrix.to(dtype)
    if matrix.dim() == 3:
        return _stacked_eigh(matrix)
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


def _stacked_eigh(matrices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`psd_eigh` of each of ``matrices [G, d, d]`` (finite): one batched solve for those
    whose diagonal has no zero, matrix by matrix for the others and for any whose batched result
    is not finite."""
    if not bool(matrices.isfinite().all()):
        raise torch.linalg.LinAlgError(
            f"psd_eigh: the {tuple(matrices.shape)} matrices have non-finite entries"
        )
    values = matrices.new_empty(matrices.shape[:-1])
    vectors = torch.empty_like(matrices)
    alone = (matrices.diagonal(dim1=-2, dim2=-1) == 0).any(-1)
    batched = (~alone).nonzero().squeeze(1)
    if len(batched):
        found, bases = torch.linalg.eigh(matrices[batched])
        values[batched], vectors[batched] = found.clamp(min=0), bases
        failed = ~(found.isfinite().all(-1) & bases.isfinite().flatten(1).all(-1))
        alone[batched[failed]] = True
    for g in alone.nonzero().squeeze(1).tolist():
        values[g], vectors[g] = psd_eigh(matrices[g])
    return values, vectors
