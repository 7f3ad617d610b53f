"""The trace-norm damping applied in the factors' eigenbases
(``KFAC(kronecker_damping="trace_norm_eigh")``).

With ``F = Q diag(s) Qᵀ`` for each factor, its damped inverse at any shift ``c`` is::

    (F + c I)⁻¹ = Q diag(1 / (s + c)) Qᵀ

and the trace-norm split needs only the traces ``tr F = Σ s``: ``c_B = √λ/π``, ``c_A = π√λ``,
``π = sqrt((Σ s_A / dim A) / (Σ s_B / dim B))`` (``optim.kronecker.trace_norm_shifts``). So one
eigendecomposition per factor (:func:`trace_norm_eigh`) serves every ``λ`` and every ``π``
(:func:`eigh_solvers`): exactly ``(B + c_B I)⁻¹ ⊗ (A + c_A I)⁻¹`` of the decomposed factors.

A decomposition is ``(s, Q)`` per factor: ``s`` its eigenvalues found (ascending; a factor with a
Gram root of ``r`` rows, ``F = UᵀU``, is decomposed through the ``r × r`` matrix ``U Uᵀ`` and has
no others: the rest are 0), ``Q [d, k]`` the eigenvectors of the last ``k`` of them. ``k < d``
gives the rank-``k`` form ``(I − VᵀV)/c`` (``LowRankInverse.from_eigh``): exact for a Gram root
(the columns span ``F``'s range), the best rank-``k`` approximation ``(F_k + c I)⁻¹`` under a
rank cap ``max_rank = k`` (the other directions see the damping only; ``tr F`` is still the
full one).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from curvopt.core.psd import psd_eigh
from curvopt.core.reductions import dense
from curvopt.optim.factor_inverse import (
    Factors,
    LowRankInverse,
    capped,
    promoted,
    trace_norm_shifts,
    usable_root,
)

Decomposition = Sequence[tuple[torch.Tensor, torch.Tensor]]


def trace_norm_eigh(
    factors: Factors, low_rank: bool = True, max_rank: int | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``[(s_B, Q_B), (s_A, Q_A)]`` (``[(s_B, Q_B)]`` for a bias), see the module doc: through
    the Gram root where ``low_rank`` and it is cheaper (``factor_inverse.usable_root``), else
    ``psd_eigh``, in float32 for bfloat16/float16 factors; ``Q`` keeps the top ``max_rank``
    eigenvectors of a factor wider than ``2 · max_rank`` (``kronecker.capped``), all
    otherwise."""
    sizes = [f.shape[0] for f in factors]
    decompositions = []
    for index, stored in enumerate(factors):
        others = sizes[1 - index] if len(factors) == 2 else 1
        factor = promoted(stored)  # bfloat16/float16 in float32, keeping the Gram root
        root = usable_root(factor, others, stored.dtype, dense_eigh=True) if low_rank else None
        if root is None:
            values, vectors = psd_eigh(dense(factor))
        else:
            values, vectors = _root_eigh(root)
        if capped(factor.shape[0], max_rank):
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
    eigenpairs. Apply with ``kronecker.kron_solve``. A rank-``k`` form with a shift that is not
    positive raises ``torch.linalg.LinAlgError`` (it would divide by zero)."""
    means = [s.sum() / q.shape[0] for s, q in decompositions]
    solvers = []
    for (values, vectors), shift in zip(decompositions, trace_norm_shifts(means, damping)):
        dim, kept = vectors.shape
        if kept == dim:
            solvers.append((vectors / (values + shift)) @ vectors.mT)
            continue
        if not float(shift) > 0:
            raise torch.linalg.LinAlgError(
                f"Kronecker factor ({dim}, {dim}) of rank {kept} in the rank-{kept} form needs a "
                f"positive damping shift, got {float(shift):.3g}: pass damping > 0"
            )
        solvers.append(LowRankInverse.from_eigh(values[-kept:], vectors, shift))
    return solvers
