"""Low-rank damped inverses ``(F + c I)⁻¹ = (I − Vᵀ V) / c`` (:class:`LowRankInverse`).

Two sources of ``V`` (``[k, d]``, orthogonal rows, the directions of ``F``'s ``k`` kept
eigenvalues):

* a Gram root ``F = UᵀU`` with ``r < d`` rows (Woodbury, :meth:`LowRankInverse.of`): exact at
  the numerical rank of ``U``, the case of a layer wider than its batch;
* eigenpairs ``(s_i, q_i)`` of ``F`` (:meth:`LowRankInverse.from_eigh`): exact when they are all
  its nonzero ones, an approximation when only the top ``k`` are kept (``max_rank``): the other
  directions see the damping ``c`` only.

Applying one to ``m`` vectors costs ``4 m d k`` flops against ``2 m d²`` for a dense inverse
(:func:`application_flops`); the Kronecker solves (``optim.kronecker``) and the factored step
(``optim.gradient_factors``) take either form.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from curvopt.engine.reductions import gram_root
from curvopt.engine.psd import psd_eigh


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

    @classmethod
    def from_eigh(cls, values: torch.Tensor, vectors: torch.Tensor, shift) -> "LowRankInverse":
        """From eigenpairs ``F q_i = s_i q_i`` (``vectors [d, k]``, orthonormal columns) and
        ``c``: ``V = diag(s / (s + c))^(1/2) Qᵀ``, so ``(I − VᵀV) / c`` is ``1 / (s_i + c)``
        along ``q_i`` and ``1 / c`` on their complement: ``(F + c I)⁻¹`` when the ``q_i`` span
        ``F``'s range, else ``(F_k + c I)⁻¹`` for ``F_k = Σ_i s_i q_i q_iᵀ``."""
        shift = torch.as_tensor(shift, dtype=vectors.dtype, device=vectors.device)
        values = values.to(vectors.dtype).clamp(min=0)
        return cls((vectors * (values / (values + shift)).sqrt()).mT, shift)

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


def woodbury_cheaper(dim: int, rows: int, rank: int, others: int) -> bool:
    """Whether the Woodbury form of a root of ``rows`` rows and (numerical or capped) ``rank``
    costs fewer flops than the dense inverse for ``others`` right-hand sides: setup ``4 d r²``
    plus its application against ``d³`` plus the dense one (:func:`application_flops`)."""
    woodbury = 4 * dim * rows * rows + application_flops(dim, others, rank)
    return woodbury < dim**3 + application_flops(dim, others)


def usable_root(factor: torch.Tensor, others: int, stored: torch.dtype | None = None):
    """The factor's Gram root ``U [r, d]`` (``reductions.gram_root``) when the Woodbury form
    can be cheaper than the dense inverse (:func:`woodbury_cheaper` at a rank of 1: whether
    it is depends on the numerical rank, known once it is set up) and ``U`` still reproduces
    the factor (checked on the all-ones vector against the rounding bound
    ``√eps · |U|ᵀ|U| 1``: a factor changed in place after the pass falls back to the dense
    form). ``U`` comes in ``factor``'s dtype (both promoted to ``working_dtype`` by the
    caller); the bound uses the precision the factor was ``stored`` in (default: its dtype)."""
    root = gram_root(factor)
    if root is None or not woodbury_cheaper(factor.shape[0], root.shape[0], 1, others):
        return None
    magnitude = root.abs().mT @ root.abs().sum(1)
    error = (factor.sum(1) - root.mT @ root.sum(1)).abs()
    eps = torch.finfo(root.dtype if stored is None else stored).eps
    if not bool((error <= eps**0.5 * magnitude).all()):
        return None
    return root


def woodbury(root: torch.Tensor, shift, others: int, max_rank: int | None):
    """``LowRankInverse.of(root, shift, max_rank)`` where it is cheaper than the dense inverse
    at its rank, else None."""
    solver = LowRankInverse.of(root, shift, max_rank)
    rows, dim = root.shape
    return solver if woodbury_cheaper(dim, rows, solver.rank, others) else None


def capped_inverse(factor: torch.Tensor, shift, max_rank: int) -> LowRankInverse:
    """``(F_k + c I)⁻¹`` from the top ``max_rank`` eigenpairs of ``F`` (``psd_eigh``), ``F_k`` the
    best rank-``k`` approximation of ``F``: an approximation unless ``rank F ≤ k``."""
    values, vectors = psd_eigh(factor)
    kept = min(max_rank, values.shape[0])
    return LowRankInverse.from_eigh(values[-kept:], vectors[:, -kept:], shift)


# cached Woodbury inverses live in optimizer state: loadable with torch.load(weights_only=True)
torch.serialization.add_safe_globals([LowRankInverse])
