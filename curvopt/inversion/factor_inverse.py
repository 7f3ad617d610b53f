"""The damped inverse ``(F + c I)⁻¹`` of one Kronecker factor at a given shift ``c`` (which
``inversion.trace_norm`` chooses): its working precision (:func:`promoted`), and its two forms:

* dense, through the Cholesky factorisation (:func:`cholesky_factor`, :func:`cholesky_inverse`,
  :func:`cholesky_solve_right`), retried in float64 where the input's precision fails;
* low rank, ``(I − Vᵀ V) / c`` (:class:`LowRankInverse`; ``V [k, d]`` with orthogonal rows, the
  directions of ``F``'s ``k`` kept eigenvalues), from a Gram root ``F = UᵀU`` with ``r < d``
  rows (Woodbury, :meth:`LowRankInverse.of`: exact at the numerical rank of ``U``, the case of
  a layer wider than its batch), or from eigenpairs of ``F`` (:meth:`LowRankInverse.from_eigh`:
  an approximation when only the top ``k`` are kept, ``max_rank``).

Applying a low-rank one to ``m`` vectors costs ``4 m d k`` flops against ``2 m d²`` for a dense
inverse (:func:`application_flops`); which form is cheaper for a factor is decided here too
(:func:`woodbury_cheaper`, :func:`usable_root`). The Kronecker solves (``inversion.trace_norm``)
and the factored step (``optim.gradient_factors``) take either form.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from curvopt.core.psd import psd_eigh, working_dtype
from curvopt.core.reductions import GramFactor, dense, gram_root
from curvopt.core.values import rescaled


def add_diagonal(matrix: torch.Tensor, shift) -> torch.Tensor:
    """``M + shift · I`` as a new tensor (one copy; no identity matrix is formed); for stacked
    ``M [G, d, d]`` a ``shift`` of shape ``[G, 1]`` adds each group's own."""
    result = matrix.clone()
    result.diagonal(dim1=-2, dim2=-1).add_(shift)
    return result


def capped(dim: int, max_rank: int | None) -> bool:
    """Whether ``max_rank`` caps a factor of size ``dim``: ``dim > 2 k``, where the rank-``k``
    form costs fewer flops to apply than the dense inverse (``4 m d k < 2 m d²``)."""
    return max_rank is not None and dim > 2 * max_rank


def promoted(factor):
    """``factor`` in ``working_dtype`` (float32 for bfloat16/float16), keeping its Gram root
    (a :class:`~curvopt.core.reductions.GramFactor`: its root in that dtype)."""
    dtype = working_dtype(factor.dtype)
    if dtype == factor.dtype:
        return factor
    return factor.to(dtype) if isinstance(factor, GramFactor) else rescaled(factor, 1.0, dtype)


def _cholesky(
    matrix: torch.Tensor, in_float64: Callable[[], torch.Tensor] | None = None
) -> torch.Tensor:
    """``L`` of ``M``, in float64 when the input's precision fails (raises if that fails);
    ``in_float64()`` gives ``M`` computed in float64 for the retry (default: ``M`` cast)."""
    factor, info = torch.linalg.cholesky_ex(matrix)
    failed = _failed(info)
    if failed and matrix.dtype != torch.float64:
        exact = matrix.to(torch.float64) if in_float64 is None else in_float64()
        factor, info = torch.linalg.cholesky_ex(exact)
        failed = _failed(info)
    if failed:
        raise torch.linalg.LinAlgError(
            f"cholesky: the {tuple(matrix.shape)} matrix is not positive definite, even in "
            "float64; increase the damping so that curvature + damping is positive definite. "
            "If its entries exploded (the steps diverged), keep the optimizer's trust region "
            "on (kl_clip, default 1e-3; kl_clip=None is the unclipped update) or lower lr"
        )
    return factor


def _failed(info: torch.Tensor) -> bool:
    """Whether a Cholesky factorisation failed: its ``info`` (a scalar, ``[G]`` for a stack of
    matrices) is nonzero; a scalar read as it is, with no reduction."""
    return bool(info.any() if info.dim() else info)


def cholesky_factor(
    matrix: torch.Tensor, in_float64: Callable[[], torch.Tensor] | None = None
) -> torch.Tensor:
    """The lower-triangular Cholesky factor ``L`` with ``M = L Lᵀ``.

    Factorised in ``working_dtype`` (``M`` in bfloat16/float16 is promoted to float32, and
    ``L`` returned in float32). If the factorisation fails in that precision (a near-singular
    ``M`` in float32), it is retried in float64 (on ``in_float64()`` if given: ``M`` recomputed
    from float64 inputs, else ``M`` cast) and ``L`` cast back.

    Args:
        matrix: ``M``, symmetric positive definite, ``[d, d]``.
        in_float64: optional callable returning ``M`` computed in float64, for the retry.

    Returns:
        ``L``, ``[d, d]``.

    Raises:
        torch.linalg.LinAlgError: ``M`` is not positive definite even in float64.

    Example:
        >>> import torch
        >>> from curvopt.optim import cholesky_factor
        >>> M = torch.tensor([[4.0, 2.0], [2.0, 2.0]])
        >>> L = cholesky_factor(M)
        >>> torch.allclose(L @ L.T, M)
        True
    """
    dtype = working_dtype(matrix.dtype)
    return _cholesky(matrix.to(dtype), in_float64).to(dtype)


def cholesky_solve_right(matrix: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """The right solve ``X M⁻¹ = X L⁻ᵀ L⁻¹`` from a Cholesky factor, no inverse formed.

    Two triangular solves (``2 m d²`` flops, as many as ``X @ M⁻¹``).

    Args:
        matrix: ``X``, ``[m, d]``.
        factor: ``L = cholesky_factor(M)``, ``[d, d]``.

    Returns:
        ``X M⁻¹``, ``[m, d]``.

    Example:
        >>> import torch
        >>> from curvopt.optim import cholesky_factor, cholesky_solve_right
        >>> M = torch.tensor([[4.0, 2.0], [2.0, 2.0]])
        >>> X = torch.tensor([[1.0, 0.0]])
        >>> torch.allclose(cholesky_solve_right(X, cholesky_factor(M)), X @ torch.linalg.inv(M))
        True
    """
    return torch.linalg.solve_triangular(
        factor,
        torch.linalg.solve_triangular(factor.mT, matrix, upper=True, left=False),
        upper=False,
        left=False,
    )


def cholesky_inverse(matrix: torch.Tensor) -> torch.Tensor:
    """The inverse ``M⁻¹ = L⁻ᵀ L⁻¹`` of a symmetric positive definite matrix, by Cholesky.

    As :func:`cholesky_factor` (float32 at least), a failed factorisation is retried in float64
    (the inverse is computed there and cast back).

    Args:
        matrix: ``M``, ``[d, d]``.

    Returns:
        ``M⁻¹``, ``[d, d]``.

    Raises:
        torch.linalg.LinAlgError: ``M`` is not positive definite even in float64.

    Example:
        >>> import torch
        >>> from curvopt.optim import cholesky_inverse
        >>> cholesky_inverse(torch.tensor([[2.0, 0.0], [0.0, 4.0]])).diagonal()
        tensor([0.5000, 0.2500])
    """
    dtype = working_dtype(matrix.dtype)
    return torch.cholesky_inverse(_cholesky(matrix.to(dtype))).to(dtype)


@dataclass(frozen=True)
class LowRankInverse:
    """The damped inverse of a low-rank factor by Woodbury: ``(UᵀU + c I)⁻¹ = (I − Vᵀ V) / c``.

    For a factor ``F = UᵀU`` of size ``d`` with a root ``U [r, d]``, ``r < d``, and a shift
    ``c > 0``: with ``U Uᵀ = Q diag(s) Qᵀ``, ``Uᵀ (c I_r + U Uᵀ)⁻¹ U = Vᵀ V`` for
    ``V = diag(s + c)^(-1/2) Qᵀ U`` (``[k, d]``, computed once; its rows are orthogonal, the
    directions of ``F``'s nonzero eigenvalues). Applying it to ``m`` vectors costs ``4 m d k``
    flops (two matrix products, no solve) instead of the ``2 m d²`` of a product with the dense
    inverse, and setting it up ``4 d r² + O(r³)`` instead of ``d³``. ``k ≤ r`` is the numerical
    rank of ``U`` (exact compression, :meth:`of`), or a cap on it (an approximation). Build it
    with :meth:`of` or :meth:`from_eigh`.

    Args:
        basis: ``V``, ``[k, d]``.
        shift: ``c``, a scalar tensor.

    Example:
        >>> import torch
        >>> from curvopt.optim import LowRankInverse
        >>> U = torch.tensor([[1.0, 0.0, 0.0]], dtype=torch.float64)  # F = diag(1, 0, 0)
        >>> inverse = LowRankInverse.of(U, shift=1.0)
        >>> inverse.rank
        1
        >>> inverse.solve_left(torch.eye(3, dtype=torch.float64)).diagonal()
        tensor([0.5000, 1.0000, 1.0000], dtype=torch.float64)
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

    def to(self, *args, **kwargs) -> "LowRankInverse":
        """As ``Tensor.to`` (dtype, device), on ``V`` and ``c``; ``self`` where nothing changes."""
        basis, shift = self.basis.to(*args, **kwargs), self.shift.to(*args, **kwargs)
        return self if basis is self.basis and shift is self.shift else LowRankInverse(basis, shift)

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
    """:func:`application_flops` of one entry of ``trace_norm.trace_norm_solvers`` /
    ``trace_norm.trace_norm_cholesky`` (a dense matrix or a :class:`LowRankInverse`)."""
    return application_flops(
        dim, columns, solver.rank if isinstance(solver, LowRankInverse) else None
    )


#: an ``n × n`` symmetric eigendecomposition costs about ``EIGH_COST · n³`` in the units where the
#: dense inverse of a factor of size ``d`` costs ``d³``: fitted on CPU to a 3136-wide factor
#: (``benchmarks/results/gram_factor.md`` has the measurements)
EIGH_COST = 20


def woodbury_cheaper(dim: int, rows: int, rank: int, others: int, dense_eigh: bool = False) -> bool:
    """Whether the Woodbury form of a root of ``rows`` rows and (numerical or capped) ``rank``
    costs fewer flops than the dense form for ``others`` right-hand sides: setup ``4 d r²`` (the
    Gram ``U Uᵀ`` and ``V``) plus ``EIGH_COST · r³`` (its eigendecomposition) plus its
    application, against the dense setup (``d³``, or ``EIGH_COST · d³`` for an eigendecomposition:
    ``dense_eigh``) plus the dense application (:func:`application_flops`)."""
    woodbury = 4 * dim * rows * rows + EIGH_COST * rows**3 + application_flops(dim, others, rank)
    dense_setup = (EIGH_COST if dense_eigh else 1) * dim**3
    return woodbury < dense_setup + application_flops(dim, others)


def root_alone(rows: int, dim: int) -> bool:
    """Whether a Gram root of ``rows`` rows stands for a factor of size ``dim`` on its own (an
    average kept as a :class:`~curvopt.core.reductions.GramFactor`): where its Woodbury form is
    the cheaper one whatever the other side, ``rows ≤ dim / 2`` (``4 m d k ≤ 2 m d²``) and
    ``4 d r² + EIGH_COST · r³ < d³`` (:func:`woodbury_cheaper`)."""
    return 2 * rows <= dim and woodbury_cheaper(dim, rows, rows, 0)


def usable_root(factor, others: int, stored: torch.dtype | None = None, dense_eigh: bool = False):
    """The factor's Gram root ``U [r, d]`` (``reductions.gram_root``) when the Woodbury form
    can be cheaper than the dense form (:func:`woodbury_cheaper` at a rank of 1: whether
    it is depends on the numerical rank, known once it is set up) and ``U`` still reproduces
    the factor (checked on the all-ones vector against the rounding bound
    ``√eps · |U|ᵀ|U| 1``: a factor changed in place after the pass falls back to the dense
    form; a :class:`~curvopt.core.reductions.GramFactor` is its root). ``U`` comes in
    ``factor``'s dtype (both promoted to ``working_dtype`` by the caller); the bound uses the
    precision the factor was ``stored`` in (default: its dtype)."""
    root = gram_root(factor)
    dim = factor.shape[0]
    if root is None or not woodbury_cheaper(dim, root.shape[0], 1, others, dense_eigh):
        return None
    if isinstance(factor, GramFactor):
        return root
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
    values, vectors = psd_eigh(dense(factor))
    kept = min(max_rank, values.shape[0])
    return LowRankInverse.from_eigh(values[-kept:], vectors[:, -kept:], shift)


# cached Woodbury inverses live in optimizer state: loadable with torch.load(weights_only=True)
torch.serialization.add_safe_globals([LowRankInverse])
