"""Inverse ``p``-th roots ``A^(-1/p)`` of a symmetric positive definite matrix by the coupled
Newton iteration (Guo & Higham 2006; Shampoo's ``matrix_inverse_root``, Anil et al. 2020), with
products only (no factorisation), optionally in a lower precision and warm-started from the
last refresh's root.

The iteration keeps ``M = A Xᵖ`` (``I`` at the root)::

    X ← X T,  M ← M Tᵖ,   T = ((p + 1) I − M) / p

    cold start:  z = (p + 1) / (2 ‖A‖_F),  X₀ = z^(1/p) I,  M₀ = z A
    warm start:  X₀ = the previous inverse, M₀ = A X₀       (p = 1), where ‖M₀ − I‖_F < 1/2

From the cold start every iterate is a polynomial in ``A``, so ``M = A Xᵖ`` holds for any ``p``.
A warm start's ``X₀`` need not commute with ``A``; for ``p = 1`` the invariant holds all the
same (``A X T = M T``: Newton–Schulz's ``X ← X (2 I − A X)``), for ``p > 1`` it does not, so
only the inverse is warm-started.

It stops at ``‖M − I‖_F ≤ tolerance`` (or after ``max_iterations``). For ``p = 1`` (the damped
inverse of a Kronecker factor) ``M = X A`` and ``X − A⁻¹ = (M − I) A⁻¹``, so the result's
relative error is at most ``‖M − I‖_F``, and each step squares ``I − M`` (quadratic
convergence); for ``p > 1`` the relative error is ``‖M − I‖_F / p`` to first order. A cold
start needs about ``log₂ κ(A)`` steps before the quadratic phase; a warm start from a factor
that changed little needs one or two. Each step costs ``p + 1`` products of ``d × d`` matrices
(``2 (p + 1) d³`` flops) against the ``d³`` of a Cholesky inverse: on CPU Cholesky is faster
(``benchmarks/refresh_cost.py``), so the Kronecker inverses keep it.
"""

from __future__ import annotations

import torch


def newton_inverse_root(
    matrix: torch.Tensor,
    root: int = 1,
    previous: torch.Tensor | None = None,
    *,
    dtype: torch.dtype | None = None,
    tolerance: float = 1e-6,
    max_iterations: int = 100,
) -> tuple[torch.Tensor, int]:
    """``A^(-1/p)`` by the coupled Newton iteration (see the module), and its step count.

    Args:
        matrix: ``A``, symmetric positive definite, ``[d, d]``.
        root: ``p ≥ 1`` (1: the inverse).
        previous: an earlier inverse ``X₀ ≈ A⁻¹`` to start from (``root=1`` only); used where
            ``‖A X₀ − I‖_F < 1/2``, else the cold start.
        dtype: the dtype the products compute in (default: ``A``'s).
        tolerance: stop at ``‖Xᵖ A − I‖_F ≤ tolerance``.
        max_iterations: at most this many steps.

    Returns:
        ``(X, steps)``: ``X ≈ A^(-1/p)`` in ``A``'s dtype (symmetrised), and the steps taken.

    Raises:
        ValueError: ``root < 1``, a ``previous`` with ``root > 1``, or ``A`` is not square or
            has non-finite entries.

    Example:
        >>> import torch
        >>> A = torch.diag(torch.tensor([4.0, 16.0], dtype=torch.float64))
        >>> X, steps = newton_inverse_root(A, root=2, tolerance=1e-12)
        >>> X.diagonal()
        tensor([0.5000, 0.2500], dtype=torch.float64)
    """
    _check(matrix, root, previous)
    work = matrix.to(dtype or matrix.dtype)
    identity = torch.eye(work.shape[-1], dtype=work.dtype, device=work.device)
    root_x, coupled = _start(work, root, identity, previous)
    steps = 0
    while steps < max_iterations and _residual(coupled, identity) > tolerance:
        turn = ((root + 1) * identity - coupled) / root
        root_x = root_x @ turn
        coupled = coupled @ torch.linalg.matrix_power(turn, root)
        steps += 1
    return ((root_x + root_x.mT) / 2).to(matrix.dtype), steps


def _start(matrix, root, identity, previous):
    """``(X₀, M₀)``: warm from ``previous`` where ``‖A X₀ − I‖_F < 1/2``, else cold."""
    if previous is not None:
        start = previous.to(matrix.dtype)
        coupled = matrix @ start
        if _residual(coupled, identity) < 0.5:
            return start, coupled
    scale = (root + 1) / (2 * torch.linalg.matrix_norm(matrix))
    return identity * scale ** (1 / root), matrix * scale


def _residual(coupled: torch.Tensor, identity: torch.Tensor) -> float:
    """``‖M − I‖_F``."""
    return float(torch.linalg.matrix_norm(coupled - identity))


def _check(matrix: torch.Tensor, root: int, previous) -> None:
    if not isinstance(root, int) or root < 1:
        raise ValueError(f"newton_inverse_root: root must be an int >= 1, got {root!r}")
    if previous is not None and root != 1:
        raise ValueError(
            f"newton_inverse_root: a warm start (previous) needs root=1, got root={root}: an "
            "earlier root need not commute with the matrix; pass previous=None for a root"
        )
    if matrix.dim() != 2 or matrix.shape[0] != matrix.shape[1]:
        raise ValueError(
            f"newton_inverse_root: the matrix must be square [d, d], got {tuple(matrix.shape)}; "
            "pass one symmetric positive definite factor"
        )
    if not bool(matrix.isfinite().all()):
        raise ValueError(
            "newton_inverse_root: the matrix has non-finite entries; "
            "check the curvature it was computed from"
        )
