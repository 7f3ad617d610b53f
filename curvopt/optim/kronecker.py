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
from dataclasses import dataclass

import torch

from curvopt.optim.linalg import (
    cholesky_factor,
    cholesky_inverse,
    cholesky_solve_right,
    psd_eigh,
    working_dtype,
)
from curvopt.engine.reductions import gram_root
from curvopt.engine.values import rescaled

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


def kron_matmul(factors: Factors, matrix: torch.Tensor) -> torch.Tensor:
    """``(B ⊗ A) vec(G)`` as the matrix ``B G Aᵀ`` (``B G`` for ``[B]``); ``G``: ``[dim B, ·]``."""
    result = factors[0] @ matrix
    if len(factors) == 2:
        result = result @ factors[1].mT
    return result


def kron_quadratic(factors: Factors, matrix: torch.Tensor) -> torch.Tensor:
    """``vec(S)ᵀ (B ⊗ A) vec(S) = Σ S ⊙ (B S Aᵀ)``, a scalar tensor."""
    return (matrix * kron_matmul(factors, matrix)).sum()


def trace_norm_pi(factors: Factors) -> torch.Tensor:
    """``π = sqrt((tr A / dim A) / (tr B / dim B))`` for ``[B, A]``; 1 for ``[B]``.

    Also 1 when a trace is not positive (a zero factor), so that the damping stays ``λ I``.
    """
    if len(factors) == 1:
        return torch.ones((), dtype=factors[0].dtype, device=factors[0].device)
    mean_b, mean_a = (torch.diagonal(f).mean() for f in factors)
    usable = (mean_a > 0) & (mean_b > 0)
    ratio = torch.where(usable, mean_a / torch.where(usable, mean_b, 1), 1)
    return ratio.sqrt()


def trace_norm_damped(factors: Factors, damping: float) -> list[torch.Tensor]:
    """``[B + √λ/π I, A + π√λ I]`` for ``[B, A]``; ``[B + λ I]`` for ``[B]``."""
    return [
        _add_diagonal(f, shift) for f, shift in zip(factors, _trace_norm_shifts(factors, damping))
    ]


def _trace_norm_shifts(factors: Factors, damping: float) -> list:
    """The damping added to each factor: ``[√λ/π, π√λ]`` for ``[B, A]``; ``[λ]`` for ``[B]``.

    With ``π² = (tr A/dim A)/(tr B/dim B)`` each shift is ``√λ`` times its factor's mean
    eigenvalue over the geometric mean of both, so their product is ``λ``."""
    if len(factors) == 1:
        return [damping]
    pi = trace_norm_pi(factors)
    root = damping**0.5
    return [root / pi, pi * root]


def _add_diagonal(matrix: torch.Tensor, shift) -> torch.Tensor:
    """``M + shift · I`` as a new tensor (one copy; no identity matrix is formed)."""
    result = matrix.clone()
    result.diagonal().add_(shift)
    return result


def trace_norm_inverse(factors: Factors, damping: float) -> list[torch.Tensor]:
    """Inverses of :func:`trace_norm_damped` (Cholesky, float64 retry); apply with
    :func:`kron_matmul`."""
    return [cholesky_inverse(f) for f in trace_norm_damped(factors, damping)]


@dataclass(frozen=True)
class LowRankInverse:
    """``(UᵀU + c I)⁻¹ = (I − Vᵀ V) / c`` for a factor ``F = UᵀU`` of size ``d`` with a root
    ``U [r, d]``, ``r < d``, and a shift ``c > 0`` (Woodbury): with ``U Uᵀ = Q diag(s) Qᵀ``,
    ``Uᵀ (c I_r + U Uᵀ)⁻¹ U = Vᵀ V`` for ``V = diag(s + c)^(-1/2) Qᵀ U`` (``[k, d]``, computed
    once; its rows are orthogonal, the directions of ``F``'s nonzero eigenvalues).

    Applying it to ``m`` vectors costs ``4 m d k`` flops (two matrix products, no solve)
    instead of the ``2 m d²`` of a product with the dense inverse, and setting it up
    ``4 d r² + O(r³)`` instead of ``d³``. ``k ≤ r`` is the numerical rank of ``U`` (exact
    compression, :meth:`of`), or a cap on it (an approximation).
    """

    basis: torch.Tensor
    shift: torch.Tensor

    @classmethod
    def of(cls, root: torch.Tensor, shift, max_rank: int | None = None) -> "LowRankInverse":
        """From ``U`` and ``c``. Exact (default): the directions whose eigenvalue ``s_i`` of
        ``U Uᵀ`` is at most its rounding, ``r · eps · s_max``, and negligible against the shift,
        ``s_i ≤ √eps · c`` (dropping one changes the result along it by ``s_i / c`` relative),
        are dropped: rows repeated in the stacked roots of an average add no rank, and cost
        nothing to apply.

        ``max_rank=k`` keeps at most the ``k`` largest (an approximation): it inverts
        ``F_k + c I``, ``F_k`` the best rank-``k`` approximation of ``F``; the dropped
        directions see the damping only (their ``s_i`` are replaced by 0).

        ``U Uᵀ`` and its eigendecomposition are recomputed from ``U`` in float64 when their
        rounding in ``U``'s precision, ``eps · s_max``, exceeds ``√eps · c``: the eigenvalues
        near the shift would be lost in it."""
        shift = torch.as_tensor(shift, dtype=root.dtype, device=root.device)
        values, vectors = torch.linalg.eigh(root @ root.mT)
        eps = torch.finfo(root.dtype).eps
        if root.dtype != torch.float64 and bool(eps * values[-1] > eps**0.5 * shift):
            exact = root.to(torch.float64)
            values, vectors = torch.linalg.eigh(exact @ exact.mT)
            values, vectors = values.to(root.dtype), vectors.to(root.dtype)
            eps = torch.finfo(torch.float64).eps
        noise = torch.minimum(root.shape[0] * eps * values[-1].clamp(min=0), eps**0.5 * shift)
        kept = int((values > noise).sum())
        kept = kept if max_rank is None else min(kept, max_rank)
        values, vectors = values[values.shape[0] - kept :], vectors[:, vectors.shape[1] - kept :]
        return cls((vectors.mT @ root) / (values + shift).sqrt()[:, None], shift)

    @property
    def rank(self) -> int:
        """``k``, the number of rows of ``V``."""
        return self.basis.shape[0]

    def solve_left(self, matrix: torch.Tensor) -> torch.Tensor:
        """``(F + c I)⁻¹ M`` for ``M [d, m]``."""
        return torch.addmm(matrix, self.basis.mT, self.basis @ matrix, alpha=-1).div_(self.shift)

    def solve_right(self, matrix: torch.Tensor) -> torch.Tensor:
        """``M (F + c I)⁻¹`` for ``M [m, d]``."""
        return torch.addmm(matrix, matrix @ self.basis.mT, self.basis, alpha=-1).div_(self.shift)


def application_flops(dim: int, columns: int, rank: int | None = None) -> int:
    """Flops of applying a damped factor's inverse of size ``dim`` to ``columns`` vectors:
    ``2 · columns · d²`` dense, ``4 · columns · d · k`` in the Woodbury form of rank ``k``."""
    return 2 * columns * dim * dim if rank is None else 4 * columns * dim * rank


def solver_flops(solver, dim: int, columns: int) -> int:
    """:func:`application_flops` of one entry of :func:`trace_norm_solvers` /
    :func:`trace_norm_cholesky` (a dense matrix or a :class:`LowRankInverse`)."""
    return application_flops(
        dim, columns, solver.rank if isinstance(solver, LowRankInverse) else None
    )


def _woodbury_cheaper(dim: int, rows: int, rank: int, others: int) -> bool:
    """Whether the Woodbury form of a root of ``rows`` rows and (numerical or capped) ``rank``
    costs fewer flops than the dense inverse for ``others`` right-hand sides: setup ``4 d r²``
    plus its application against ``d³`` plus the dense one (:func:`application_flops`)."""
    woodbury = 4 * dim * rows * rows + application_flops(dim, others, rank)
    return woodbury < dim**3 + application_flops(dim, others)


def _usable_root(factor: torch.Tensor, others: int, stored: torch.dtype | None = None):
    """The factor's Gram root ``U [r, d]`` (``reductions.gram_root``) when the Woodbury form
    can be cheaper than the dense inverse (:func:`_woodbury_cheaper` at a rank of 1: whether
    it is depends on the numerical rank, known once it is set up) and ``U`` still reproduces
    the factor (checked on the all-ones vector against the rounding bound
    ``√eps · |U|ᵀ|U| 1``: a factor changed in place after the pass falls back to the dense
    form). ``U`` comes in ``factor``'s dtype (both promoted to ``working_dtype`` by the
    caller); the bound uses the precision the factor was ``stored`` in (default: its dtype)."""
    root = gram_root(factor)
    if root is None or not _woodbury_cheaper(factor.shape[0], root.shape[0], 1, others):
        return None
    magnitude = root.abs().mT @ root.abs().sum(1)
    error = (factor.sum(1) - root.mT @ root.sum(1)).abs()
    eps = torch.finfo(root.dtype if stored is None else stored).eps
    if not bool((error <= eps**0.5 * magnitude).all()):
        return None
    return root


def _woodbury(root: torch.Tensor, shift, others: int, max_rank: int | None):
    """``LowRankInverse.of(root, shift, max_rank)`` where it is cheaper than the dense inverse
    at its rank, else None."""
    solver = LowRankInverse.of(root, shift, max_rank)
    rows, dim = root.shape
    return solver if _woodbury_cheaper(dim, rows, solver.rank, others) else None


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
    factors = [_promoted(f) for f in factors]
    shifts = _trace_norm_shifts(factors, damping)
    sizes = [f.shape[0] for f in factors]
    solvers = []
    for index, (factor, shift) in enumerate(zip(factors, shifts)):
        others = sizes[1 - index] if len(factors) == 2 else 1
        usable = low_rank and damping > 0
        root = _usable_root(factor, others, stored[index]) if usable else None
        try:
            solver = None if root is None else _woodbury(root, shift, others, max_rank)
            solvers.append(dense(_add_diagonal(factor, shift)) if solver is None else solver)
        except torch.linalg.LinAlgError as error:
            raise torch.linalg.LinAlgError(
                f"{_FACTOR_NAMES[len(factors)][index]} {tuple(factor.shape)} (trace "
                f"{float(factor.trace()):.3g}, damping shift {float(shift):.3g}"
                f"{', Woodbury form' if root is not None else ''}): {error}"
            ) from None
    return solvers


#: the factors' names by list length, as in the API order ``[B, A]`` / ``[B]``
_FACTOR_NAMES = {
    1: ["Kronecker factor B (bias)"],
    2: ["output-side Kronecker factor B", "input-side Kronecker factor A"],
}


def _promoted(factor: torch.Tensor) -> torch.Tensor:
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


# cached Woodbury inverses live in optimizer state: loadable with torch.load(weights_only=True)
torch.serialization.add_safe_globals([LowRankInverse])
