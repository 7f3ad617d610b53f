"""Kronecker-factored curvature ``C = B ⊗ A``: damping, inversion and application.

Factors come as a list in the API order: ``[B, A]`` for a weight of shape ``[out, in, *k]``
(``B``: ``[out, out]``, output side; ``A``: ``[in·k, in·k]``, input side) or ``[B]`` for a bias.
A gradient is handled as the matrix ``G = grad.reshape(out, -1)`` of shape ``[out, in·k]``
(``[out, 1]`` for a bias), so that with row-major ``vec``::

    (B ⊗ A) vec(G) = vec(B G Aᵀ)

and ``B ⊗ A`` is never formed. Two ways to damp by ``λ``:

* trace-norm (:func:`trace_norm_inverse`): ``(B + √λ/π I)⁻¹ ⊗ (A + π√λ I)⁻¹`` with
  ``π = sqrt((tr A / dim A) / (tr B / dim B))`` (Martens & Grosse 2015, Sec. 6.3: each factor
  is damped in proportion to its own scale, the input side ``A`` gets ``π√λ``); what the
  optimizer applies: the damped factors' inverses (:func:`trace_norm_solvers`, through their
  Cholesky factors) applied by matrix products (:func:`kron_solve`; or the Cholesky factors
  and triangular solves, :func:`trace_norm_cholesky` + :func:`kron_cholesky_solve`, the same
  numbers at half the speed); a factor ``F = UᵀU`` with a root of ``r < d`` rows (a batch
  smaller than the layer's width, see ``reductions.gram_root``) is inverted by Woodbury
  instead (:class:`LowRankInverse`);
* exact (:func:`kron_eigh` + :func:`exact_damped_solve`): ``(B ⊗ A + λ I)⁻¹`` from the
  eigendecompositions of both factors.

A single factor ``[B]`` is damped plainly: ``(B + λ I)⁻¹`` in both cases.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Callable

import torch

from curvopt.engine.psd import working_dtype
from curvopt.engine.values import rescaled
from curvopt.optim.low_rank import LowRankInverse, capped_inverse, usable_root, woodbury

Factors = Sequence[torch.Tensor]


def as_matrix(grad: torch.Tensor, factors: Factors) -> torch.Tensor:
    """``grad`` (any shape) as the ``[dim B, dim A]`` (or ``[dim B, 1]``) matrix ``G``.

    Raises ``ValueError`` when the factor sizes do not multiply to ``grad.numel()``.
    """
    sizes = [f.shape[0] for f in factors]
    expected = sizes[0] * (sizes[1] if len(sizes) == 2 else 1)
    if len(sizes) not in (1, 2) or expected != grad.numel():
        raise ValueError(
            f"Kronecker factors of sizes {sizes} do not match a parameter of shape "
            f"{tuple(grad.shape)}: expected [B, A] with dim B * dim A == numel or [B] with "
            "dim B == numel"
        )
    return grad.reshape(sizes[0], -1)


def trace_norm_pi(factors: Factors) -> torch.Tensor:
    """``π = sqrt((tr A / dim A) / (tr B / dim B))`` for ``[B, A]``; 1 for ``[B]``.

    Also 1 when a trace is not positive (a zero factor), so that the damping stays ``λ I``.
    """
    if len(factors) == 1:
        return torch.ones((), dtype=factors[0].dtype, device=factors[0].device)
    return _pi(*(torch.diagonal(f).mean() for f in factors))


def _pi(mean_b: torch.Tensor, mean_a: torch.Tensor) -> torch.Tensor:
    """``sqrt(mean_a / mean_b)``, 1 unless both are positive."""
    usable = (mean_a > 0) & (mean_b > 0)
    ratio = torch.where(usable, mean_a / torch.where(usable, mean_b, 1), 1)
    return ratio.sqrt()


def trace_norm_damped(factors: Factors, damping: float) -> list[torch.Tensor]:
    """``[B + √λ/π I, A + π√λ I]`` for ``[B, A]``; ``[B + λ I]`` for ``[B]``."""
    return [
        _add_diagonal(f, shift) for f, shift in zip(factors, _trace_norm_shifts(factors, damping))
    ]


def _trace_norm_shifts(factors: Factors, damping: float) -> list:
    """The damping added to each factor (:func:`trace_norm_shifts` of their mean diagonals)."""
    return trace_norm_shifts([torch.diagonal(f).mean() for f in factors], damping)


def trace_norm_shifts(means: Sequence[torch.Tensor], damping: float) -> list:
    """The damping added to each factor, from their mean eigenvalues ``tr F / dim F``:
    ``[√λ/π, π√λ]`` for ``[B, A]`` (``π = sqrt(mean_A / mean_B)``, 1 unless both are
    positive); ``[λ]`` for ``[B]``.

    Each shift is ``√λ`` times its factor's mean eigenvalue over the geometric mean of both, so
    their product is ``λ``."""
    if len(means) == 1:
        return [damping]
    pi = _pi(*means)
    root = damping**0.5
    return [root / pi, pi * root]


def _add_diagonal(matrix: torch.Tensor, shift) -> torch.Tensor:
    """``M + shift · I`` as a new tensor (one copy; no identity matrix is formed)."""
    result = matrix.clone()
    result.diagonal().add_(shift)
    return result


def trace_norm_inverse(factors: Factors, damping: float) -> list[torch.Tensor]:
    """Inverses of :func:`trace_norm_damped` (Cholesky, float64 retry); apply with
    :func:`kron_exact.kron_matmul`."""
    return [cholesky_inverse(f) for f in trace_norm_damped(factors, damping)]


def trace_norm_cholesky(
    factors: Factors, damping: float, low_rank: bool = True, max_rank: int | None = None
) -> list[torch.Tensor | LowRankInverse]:
    """Per factor of :func:`trace_norm_damped`: its Cholesky factor ``L`` (float64 retry, see
    ``cholesky_factor``), or, with ``low_rank`` and a positive shift, a :class:`LowRankInverse`
    (rank capped at ``max_rank``, an approximation; default exact) where the factor carries a
    Gram root that makes that cheaper (a batch smaller than the layer's width). Apply with
    :func:`kron_cholesky_solve`.

    Factors in bfloat16/float16 are factorised in float32 (``working_dtype``). A factor that
    cannot be factorised raises ``torch.linalg.LinAlgError`` naming it (output-side ``B`` or
    input-side ``A``, its size, trace and shift)."""
    return _trace_norm_solvers(factors, damping, low_rank, max_rank, cholesky_factor)


def trace_norm_solvers(
    factors: Factors, damping: float, low_rank: bool = True, max_rank: int | None = None
) -> list[torch.Tensor | LowRankInverse]:
    """As :func:`trace_norm_cholesky`, with the dense inverse ``(F + c I)⁻¹`` (``cholesky_inverse``)
    in place of ``L``: what ``KFAC`` caches. Apply with :func:`kron_solve`.

    A product with the inverse costs the flops of two triangular solves but runs about twice
    as fast (one matrix product; 1024 x 3136 right-hand sides, one thread: 61 ms against
    102-140 ms), and forming it from ``L`` costs ``2d³/3`` once per inversion."""
    return _trace_norm_solvers(factors, damping, low_rank, max_rank, cholesky_inverse)


def _trace_norm_solvers(factors, damping, low_rank, max_rank, dense) -> list:
    """Per damped factor: ``dense(F + c I)`` or a :class:`LowRankInverse` (see the callers)."""
    stored = [f.dtype for f in factors]
    factors = [promoted(f) for f in factors]
    shifts = _trace_norm_shifts(factors, damping)
    sizes = [f.shape[0] for f in factors]
    solvers = []
    for index, (factor, shift) in enumerate(zip(factors, shifts)):
        others = sizes[1 - index] if len(factors) == 2 else 1
        usable = low_rank and damping > 0
        root = usable_root(factor, others, stored[index]) if usable else None
        try:
            solver = None if root is None else woodbury(root, shift, others, max_rank)
            if solver is None and usable and capped(factor.shape[0], max_rank):
                solver = capped_inverse(factor, shift, max_rank)
            solvers.append(dense(_add_diagonal(factor, shift)) if solver is None else solver)
        except torch.linalg.LinAlgError as error:
            raise torch.linalg.LinAlgError(
                f"{_FACTOR_NAMES[len(factors)][index]} {tuple(factor.shape)} (trace "
                f"{float(factor.trace()):.3g}, damping shift {float(shift):.3g}"
                f"{', Woodbury form' if root is not None else ''}): {error}"
            ) from None
    return solvers


def capped(dim: int, max_rank: int | None) -> bool:
    """Whether ``max_rank`` caps a factor of size ``dim``: ``dim > 2 k``, where the rank-``k``
    form costs fewer flops to apply than the dense inverse (``4 m d k < 2 m d²``)."""
    return max_rank is not None and dim > 2 * max_rank


#: the factors' names by list length, as in the API order ``[B, A]`` / ``[B]``
_FACTOR_NAMES = {
    1: ["Kronecker factor B (bias)"],
    2: ["output-side Kronecker factor B", "input-side Kronecker factor A"],
}


def promoted(factor: torch.Tensor) -> torch.Tensor:
    """``factor`` in ``working_dtype`` (float32 for bfloat16/float16), keeping its Gram root."""
    dtype = working_dtype(factor.dtype)
    return factor if dtype == factor.dtype else rescaled(factor, 1.0, dtype)


def kron_cholesky_solve(solvers: Sequence, matrix: torch.Tensor) -> torch.Tensor:
    """``(B ⊗ A)⁻¹ vec(G)`` as the matrix ``B⁻¹ G A⁻¹`` (``B⁻¹ G`` for ``[B]``), from the
    entries of :func:`trace_norm_cholesky`: Cholesky factors ``L`` (``B = L_B L_Bᵀ``) solved by
    triangular solves (``2 dim_B² dim_A + 2 dim_B dim_A²`` flops), or :class:`LowRankInverse`
    applied by Woodbury. Solved in the solvers' precision; the result has ``matrix``'s dtype.
    """
    return _kron_apply(solvers, matrix, torch.cholesky_solve, cholesky_solve_right)


def kron_solve(solvers: Sequence, matrix: torch.Tensor) -> torch.Tensor:
    """``B⁻¹ G A⁻¹`` (``B⁻¹ G`` for ``[B]``) from the entries of :func:`trace_norm_solvers`:
    dense inverses applied by matrix products, or :class:`LowRankInverse` by Woodbury. In the
    solvers' precision; the result has ``matrix``'s dtype."""
    return _kron_apply(solvers, matrix, lambda m, f: f @ m, lambda m, f: m @ f)


def _kron_apply(solvers, matrix, dense_left, dense_right) -> torch.Tensor:
    """``B⁻¹ G A⁻¹`` with dense entries applied as ``dense_left(G, ·)`` / ``dense_right(G, ·)``
    and :class:`LowRankInverse` entries by Woodbury."""
    dtype = matrix.dtype
    left = solvers[0]
    matrix = matrix.to(left.basis.dtype if isinstance(left, LowRankInverse) else left.dtype)
    if isinstance(left, LowRankInverse):
        result = left.solve_left(matrix)
    else:
        result = dense_left(matrix, left)
    if len(solvers) == 2:
        right = solvers[1]
        if isinstance(right, LowRankInverse):
            result = right.solve_right(result)
        else:
            result = dense_right(result, right)
    return result.to(dtype)


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
