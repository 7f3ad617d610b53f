"""Trace-norm damping of a Kronecker block (Martens & Grosse 2015, Sec. 6.3): the damping ``λ``
split over the factors in proportion to their scales, and the solves with the damped factors.

For ``[B, A]`` the block ``B ⊗ A + λ I`` is replaced by ``(B + √λ/π I) ⊗ (A + π√λ I)`` with
``π = sqrt((tr A / dim A) / (tr B / dim B))`` (:func:`trace_norm_pi`, :func:`trace_norm_shifts`;
the input side ``A`` gets ``π√λ``); a single factor ``[B]`` is damped plainly, ``B + λ I``. Each
damped factor is inverted on its own (``inversion.factor_inverse``), in one of three forms:

* Cholesky factors (:func:`trace_norm_cholesky`), solved by triangular solves
  (:func:`kron_cholesky_solve`): what a default ``KFAC`` step applies;
* dense inverses (:func:`trace_norm_solvers`, :func:`trace_norm_inverse`), applied by matrix
  products (:func:`kron_solve`, twice as fast): what ``KFAC`` caches when an inverse is reused;
* in the factors' eigenbases (``KFAC(kronecker_damping="trace_norm_eigh")``,
  :func:`trace_norm_eigh`, :func:`eigh_solvers`): with ``F = Q diag(s) Qᵀ``,
  ``(F + c I)⁻¹ = Q diag(1 / (s + c)) Qᵀ``, and the split needs only the traces ``tr F = Σ s``,
  so one eigendecomposition per factor serves every ``λ`` and every ``π``.

In the first two forms a factor ``F = UᵀU`` with a root of ``r < d`` rows (a batch smaller than
the layer's width, see ``reductions.gram_root``) is inverted by Woodbury instead
(:class:`~curvopt.inversion.factor_inverse.LowRankInverse`). An eigendecomposition is ``(s, Q)`` per
factor: ``s`` its eigenvalues found (ascending; a factor with a Gram root of ``r`` rows is
decomposed through the ``r × r`` matrix ``U Uᵀ`` and has no others: the rest are 0), ``Q [d, k]``
the eigenvectors of the last ``k`` of them. ``k < d`` gives the rank-``k`` form ``(I − VᵀV)/c``
(``LowRankInverse.from_eigh``): exact for a Gram root (the columns span ``F``'s range), the best
rank-``k`` approximation ``(F_k + c I)⁻¹`` under a rank cap ``max_rank = k`` (the other
directions see the damping only; ``tr F`` is still the full one).

Factors and matrices as in :mod:`curvopt.inversion.kronecker`: ``G`` of shape ``[dim B, dim A]``,
``(B ⊗ A) vec(G) = vec(B G Aᵀ)``. Stacked factors ``[G, d, d]`` (a grouped convolution's,
one block per group, ``G`` of shape ``[G, dim B, dim A]``) are damped group by group: ``π`` and
the shifts per group (``[G]``, ``[G, 1]``), each form batched over the groups (dense only:
no Gram root, no rank cap).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from curvopt.core.psd import psd_eigh
from curvopt.core.reductions import dense, diagonal
from curvopt.inversion.factor_inverse import (
    LowRankInverse,
    add_diagonal,
    capped,
    capped_inverse,
    cholesky_factor,
    cholesky_inverse,
    cholesky_solve_right,
    promoted,
    usable_root,
    woodbury,
)

#: the Kronecker factors of one parameter, in the API order ``[B, A]`` (``[B]`` for a bias)
Factors = Sequence[torch.Tensor]


def trace_norm_shifts(means: Sequence[torch.Tensor], damping: float) -> list:
    """The damping added to each factor, from their mean eigenvalues ``tr F / dim F``:
    ``[√λ/π, π√λ]`` for ``[B, A]`` (``π = sqrt(mean_A / mean_B)``, 1 unless both are
    positive); ``[λ]`` for ``[B]``.

    Each shift is ``√λ`` times its factor's mean eigenvalue over the geometric mean of both, so
    their product is ``λ``."""
    if len(means) == 1:
        return [damping]
    pi = trace_norm_ratio(*means)
    if pi.dim():  # per group: against each group's diagonal
        pi = pi.unsqueeze(-1)
    root = damping**0.5
    return [root / pi, pi * root]


def trace_norm_ratio(mean_b: torch.Tensor, mean_a: torch.Tensor) -> torch.Tensor:
    """``sqrt(mean_a / mean_b)``, 1 unless both are positive."""
    usable = (mean_a > 0) & (mean_b > 0)
    return torch.where(usable, mean_a / mean_b, 1).sqrt()  # (the unused quotients dropped)


def trace_norm_pi(factors: Factors) -> torch.Tensor:
    """The trace-norm ratio ``π = sqrt((tr A / dim A) / (tr B / dim B))`` of ``[B, A]``.

    Martens & Grosse (2015, Sec. 6.3): the damping ``λ`` is split as ``π√λ`` on the input side
    ``A`` and ``√λ/π`` on the output side ``B``.

    Args:
        factors: ``[B, A]``, or ``[B]`` (then ``π = 1``).

    Returns:
        ``π``, a scalar tensor (``[G]`` for stacked factors ``[G, d, d]``: one per group); also
        1 when a trace is not positive (a zero factor), so that the damping stays ``λ I``.

    Example:
        >>> import torch
        >>> from curvopt import optim
        >>> B, A = 2 * torch.eye(2), 8 * torch.eye(3)  # tr B / 2 = 2, tr A / 3 = 8: π = 2
        >>> optim.trace_norm_pi([B, A])
        tensor(2.)
    """
    if len(factors) == 1:
        return torch.ones((), dtype=factors[0].dtype, device=factors[0].device)
    return trace_norm_ratio(*(_mean_eigenvalue(f) for f in factors))


def trace_norm_damped(factors: Factors, damping: float) -> list[torch.Tensor]:
    """The trace-norm damped factors ``[B + √λ/π I, A + π√λ I]`` (``[B + λ I]`` for ``[B]``).

    Args:
        factors: ``[B, A]`` or ``[B]``.
        damping: ``λ ≥ 0``.

    Returns:
        The damped factors, dense.

    Example:
        >>> import torch
        >>> from curvopt import optim
        >>> B, A = 2 * torch.eye(2), 8 * torch.eye(3)  # tr B / 2 = 2, tr A / 3 = 8: π = 2
        >>> [f.diagonal().tolist() for f in optim.trace_norm_damped([B, A], damping=4.0)]
        [[3.0, 3.0], [12.0, 12.0, 12.0]]
    """
    return [
        add_diagonal(dense(f), shift)
        for f, shift in zip(factors, _trace_norm_shifts(factors, damping))
    ]


def _trace_norm_shifts(factors: Factors, damping: float) -> list:
    """The damping added to each factor (:func:`trace_norm_shifts` of their mean diagonals)."""
    return trace_norm_shifts([_mean_eigenvalue(f) for f in factors], damping)


def _mean_eigenvalue(factor) -> torch.Tensor:
    """``tr F / dim F``: a scalar tensor, ``[G]`` for stacked factors ``[G, d, d]``."""
    values = diagonal(factor)
    return values.mean() if values.dim() == 1 else values.mean(-1)


def trace_norm_inverse(factors: Factors, damping: float) -> list[torch.Tensor]:
    """The inverses of :func:`trace_norm_damped`'s factors (Cholesky, float64 retry).

    Apply them with :func:`kron_matmul`: ``(B' ⊗ A')⁻¹ vec(G) = vec(B'⁻¹ G A'⁻¹)``.

    Args:
        factors: ``[B, A]`` or ``[B]``.
        damping: ``λ ≥ 0``.

    Returns:
        ``[(B + √λ/π I)⁻¹, (A + π√λ I)⁻¹]`` (``[(B + λ I)⁻¹]``).

    Raises:
        torch.linalg.LinAlgError: a damped factor is not positive definite even in float64.

    Example:
        >>> import torch
        >>> from curvopt import optim
        >>> B, A = 2 * torch.eye(2), 8 * torch.eye(3)  # tr B / 2 = 2, tr A / 3 = 8: π = 2
        >>> inverses = optim.trace_norm_inverse([B, A], damping=4.0)
        >>> torch.allclose(inverses[0], torch.eye(2) / 3)
        True
        >>> torch.allclose(inverses[1], torch.eye(3) / 12)
        True
    """
    return [cholesky_inverse(f) for f in trace_norm_damped(factors, damping)]


def trace_norm_cholesky(
    factors: Factors, damping: float, low_rank: bool = True, max_rank: int | None = None
) -> list[torch.Tensor | LowRankInverse]:
    """Per trace-norm damped factor its Cholesky factor, or a Woodbury inverse where cheaper.

    Per factor of :func:`trace_norm_damped`: its Cholesky factor ``L``
    (:func:`cholesky_factor`, float64 retry), or, with ``low_rank`` and a positive shift, a
    :class:`LowRankInverse` where the factor carries a Gram root that makes that cheaper (a
    batch smaller than the layer's width). Factors in bfloat16/float16 are factorised in
    float32. Apply the result with :func:`kron_cholesky_solve`.

    Args:
        factors: ``[B, A]`` or ``[B]``.
        damping: ``λ ≥ 0``.
        low_rank: allow the Woodbury form (default ``True``).
        max_rank: ``None`` (default, exact) or ``k``: cap the rank of the Woodbury and
            eigenpair forms at ``k`` (an approximation).

    Returns:
        One entry per factor: a lower-triangular ``L`` or a :class:`LowRankInverse`.

    Raises:
        torch.linalg.LinAlgError: a factor cannot be factorised; the message names it
            (output-side ``B`` or input-side ``A``, its size, trace and shift).

    Example:
        >>> import torch
        >>> from curvopt import optim
        >>> B, A = 2 * torch.eye(2), 8 * torch.eye(3)  # tr B / 2 = 2, tr A / 3 = 8: π = 2
        >>> G = torch.ones(2, 3)
        >>> solvers = optim.trace_norm_cholesky([B, A], damping=4.0)
        >>> torch.allclose(optim.kron_cholesky_solve(solvers, G), G / 36)  # 1 / (3 * 12)
        True
    """
    return _trace_norm_solvers(factors, damping, low_rank, max_rank, cholesky_factor)


def trace_norm_solvers(
    factors: Factors, damping: float, low_rank: bool = True, max_rank: int | None = None
) -> list[torch.Tensor | LowRankInverse]:
    """As :func:`trace_norm_cholesky`, with the dense inverse ``(F + c I)⁻¹`` in place of ``L``.

    What ``KFAC`` caches when an inverse is applied again (``inverse_interval`` or
    ``curvature_interval`` above 1): a product with the inverse has the flops of two triangular
    solves but is one matrix product, and forming it from ``L`` costs ``2d³/3`` once per
    inversion. Apply the result with :func:`kron_solve`.

    Args:
        factors: ``[B, A]`` or ``[B]``.
        damping: ``λ ≥ 0``.
        low_rank: allow the Woodbury form (default ``True``).
        max_rank: ``None`` (default, exact) or a rank cap ``k`` (an approximation).

    Returns:
        One entry per factor: a dense inverse or a :class:`LowRankInverse`.

    Raises:
        torch.linalg.LinAlgError: a factor cannot be factorised (named in the message).

    Example:
        >>> import torch
        >>> from curvopt import optim
        >>> B, A = 2 * torch.eye(2), 8 * torch.eye(3)  # tr B / 2 = 2, tr A / 3 = 8: π = 2
        >>> G = torch.ones(2, 3)
        >>> solvers = optim.trace_norm_solvers([B, A], damping=4.0)
        >>> torch.allclose(optim.kron_solve(solvers, G), G / 36)
        True
    """
    return _trace_norm_solvers(factors, damping, low_rank, max_rank, cholesky_inverse)


def _trace_norm_solvers(factors, damping, low_rank, max_rank, inverse) -> list:
    """Per damped factor: ``inverse(F + c I)`` or a :class:`LowRankInverse` (see the callers)."""
    stored = [f.dtype for f in factors]
    factors = [promoted(f) for f in factors]
    shifts = _trace_norm_shifts(factors, damping)
    sizes = [f.shape[-1] for f in factors]
    solvers = []
    for index, (factor, shift) in enumerate(zip(factors, shifts)):
        others = sizes[1 - index] if len(factors) == 2 else 1
        usable = low_rank and damping > 0 and len(factor.shape) == 2  # (not stacked)
        root = usable_root(factor, others, stored[index]) if usable else None
        try:
            solver = None if root is None else woodbury(root, shift, others, max_rank)
            if solver is None and usable and capped(factor.shape[0], max_rank):
                solver = capped_inverse(factor, shift, max_rank)
            if solver is None:
                solver = inverse(add_diagonal(dense(factor), shift))
            solvers.append(solver)
        except torch.linalg.LinAlgError as error:
            raise torch.linalg.LinAlgError(
                f"{_FACTOR_NAMES[len(factors)][index]} {tuple(factor.shape)} (trace "
                f"{float(diagonal(factor).sum()):.3g}, damping shift "
                f"{float(torch.as_tensor(shift).min()):.3g}"
                f"{', Woodbury form' if root is not None else ''}): {error}"
            ) from None
    return solvers


#: the factors' names by list length, as in the API order ``[B, A]`` / ``[B]``
_FACTOR_NAMES = {
    1: ["Kronecker factor B (bias)"],
    2: ["output-side Kronecker factor B", "input-side Kronecker factor A"],
}


def kron_cholesky_solve(solvers: Sequence, matrix: torch.Tensor) -> torch.Tensor:
    """The Kronecker solve ``(B ⊗ A)⁻¹ vec(G)`` as the matrix ``B⁻¹ G A⁻¹`` from Cholesky factors.

    From the entries of :func:`trace_norm_cholesky`: Cholesky factors ``L`` (``B = L_B L_Bᵀ``)
    solved by triangular solves (``2 dim_B² dim_A + 2 dim_B dim_A²`` flops), or
    :class:`LowRankInverse` applied by Woodbury.

    Args:
        solvers: one entry per factor, from :func:`trace_norm_cholesky`.
        matrix: ``G``, ``[dim B, dim A]`` (``[dim B, k]`` for ``[B]``).

    Returns:
        ``B⁻¹ G A⁻¹`` (``B⁻¹ G``), solved in the solvers' precision, in ``matrix``'s dtype.

    Example:
        >>> import torch
        >>> from curvopt import optim
        >>> B, A = 2 * torch.eye(2), 8 * torch.eye(3)  # tr B / 2 = 2, tr A / 3 = 8: π = 2
        >>> solvers = optim.trace_norm_cholesky([B, A], damping=0.0)
        >>> G = torch.full((2, 3), 16.0)
        >>> torch.allclose(optim.kron_cholesky_solve(solvers, G), torch.ones(2, 3))
        True
    """
    return kron_applier(solvers, cholesky=True)(matrix)


def kron_solve(solvers: Sequence, matrix: torch.Tensor) -> torch.Tensor:
    """The Kronecker solve ``B⁻¹ G A⁻¹`` (``B⁻¹ G`` for ``[B]``) from dense inverses.

    From the entries of :func:`trace_norm_solvers`: dense inverses applied by matrix products,
    or :class:`LowRankInverse` by Woodbury.

    Args:
        solvers: one entry per factor, from :func:`trace_norm_solvers`.
        matrix: ``G``, ``[dim B, dim A]`` (``[dim B, k]`` for ``[B]``).

    Returns:
        ``B⁻¹ G A⁻¹``, in the solvers' precision, returned in ``matrix``'s dtype.

    Example:
        >>> import torch
        >>> from curvopt import optim
        >>> B, A = 2 * torch.eye(2), 8 * torch.eye(3)  # tr B / 2 = 2, tr A / 3 = 8: π = 2
        >>> solvers = optim.trace_norm_solvers([B, A], damping=0.0)
        >>> G = torch.full((2, 3), 16.0)
        >>> torch.allclose(optim.kron_solve(solvers, G), torch.ones(2, 3))
        True
    """
    return kron_applier(solvers)(matrix)


def kron_applier(
    solvers: Sequence, cholesky: bool = False
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``G ↦ B⁻¹ G A⁻¹`` (``B⁻¹ G``) of :func:`kron_solve` (``cholesky``: of
    :func:`kron_cholesky_solve`) with everything but the products resolved once: the solvers'
    precision, and per side a dense entry's product or triangular solves, or a
    :class:`LowRankInverse`'s Woodbury form. The kernels and their order are those of the
    solve (the same bits); a plain step applies a cached inverse by the function
    ``KroneckerInverse`` keeps (``inversion.kronecker``)."""
    sides = []  # the kernels themselves (partials), no wrapper to call
    for side, solver in enumerate(solvers[:2]):
        if isinstance(solver, LowRankInverse):
            sides.append(solver.solve_right if side else solver.solve_left)
        elif cholesky:
            sides.append(
                functools.partial(cholesky_solve_right, factor=solver)
                if side
                else functools.partial(torch.cholesky_solve, input2=solver)
            )
        elif side:
            sides.append(functools.partial(torch.matmul, other=solver))  # G ↦ G A⁻¹
        else:
            sides.append(functools.partial(torch.matmul, solver))  # G ↦ B⁻¹ G
    left = solvers[0]
    precision = left.basis.dtype if isinstance(left, LowRankInverse) else left.dtype

    def apply(matrix: torch.Tensor) -> torch.Tensor:
        dtype = matrix.dtype
        result = matrix if dtype is precision else matrix.to(precision)
        for side in sides:
            result = side(result)
        return result if result.dtype is dtype else result.to(dtype)

    return apply


#: the eigendecompositions ``(s, Q)`` of the factors (:func:`trace_norm_eigh`)
Decomposition = Sequence[tuple[torch.Tensor, torch.Tensor]]


def trace_norm_eigh(
    factors: Factors, low_rank: bool = True, max_rank: int | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``[(s_B, Q_B), (s_A, Q_A)]`` (``[(s_B, Q_B)]`` for a bias), see the module doc: through
    the Gram root where ``low_rank`` and it is cheaper (``factor_inverse.usable_root``), else
    ``psd_eigh``, in float32 for bfloat16/float16 factors; ``Q`` keeps the top ``max_rank``
    eigenvectors of a factor wider than ``2 · max_rank`` (``factor_inverse.capped``), all
    otherwise."""
    sizes = [f.shape[-1] for f in factors]
    decompositions = []
    for index, stored in enumerate(factors):
        others = sizes[1 - index] if len(factors) == 2 else 1
        factor = promoted(stored)  # bfloat16/float16 in float32, keeping the Gram root
        stacked = len(factor.shape) == 3  # per group: dense, all eigenpairs
        usable = low_rank and not stacked
        root = usable_root(factor, others, stored.dtype, dense_eigh=True) if usable else None
        if root is None:
            values, vectors = psd_eigh(dense(factor))
        else:
            values, vectors = _root_eigh(root)
        if not stacked and capped(factor.shape[0], max_rank):
            vectors = vectors[:, -min(max_rank, vectors.shape[1]) :]
        decompositions.append((values, vectors))
    return decompositions


def _root_eigh(root: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The nonzero eigenpairs of ``F = UᵀU`` from ``U Uᵀ = P diag(s) Pᵀ`` (in float64, ``r × r``):
    ``Q = Uᵀ P diag(s)^(-1/2)``; eigenvalues at the rounding of ``U Uᵀ`` (``r · eps · s_max``)
    are dropped, as rows repeated in a stacked root add none."""
    exact = root.to(torch.float64)
    values, vectors = torch.linalg.eigh(exact @ exact.mT)
    noise = root.shape[0] * torch.finfo(torch.float64).eps * values[-1].clamp(min=0)
    kept = values > noise
    values, vectors = values[kept], vectors[:, kept]
    basis = (exact.mT @ vectors) / values.sqrt()
    return values.to(root.dtype), basis.to(root.dtype)


def eigh_solvers(decompositions: Decomposition, damping: float) -> list:
    """Per factor the damped inverse ``(F + c I)⁻¹`` at its trace-norm shift ``c``: the dense
    ``Q diag(1/(s + c)) Qᵀ`` for a square ``Q``, else the :class:`LowRankInverse` of the kept
    eigenpairs. Apply with :func:`kron_solve`. A rank-``k`` form with a shift that is not
    positive raises ``torch.linalg.LinAlgError`` (it would divide by zero)."""
    means = [s.sum(-1) / q.shape[-2] for s, q in decompositions]
    solvers = []
    for (values, vectors), shift in zip(decompositions, trace_norm_shifts(means, damping)):
        dim, kept = vectors.shape[-2:]
        if kept == dim:
            solvers.append((vectors / (values + shift).unsqueeze(-2)) @ vectors.mT)
            continue
        if not float(shift) > 0:
            raise torch.linalg.LinAlgError(
                f"Kronecker factor ({dim}, {dim}) of rank {kept} in the rank-{kept} form needs a "
                f"positive damping shift, got {float(shift):.3g}: pass damping > 0"
            )
        solvers.append(LowRankInverse.from_eigh(values[-kept:], vectors, shift))
    return solvers
