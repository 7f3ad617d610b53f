"""``EKFAC``: eigenvalue-corrected Kronecker curvature over a data set, and the damped inverse
``optim.EKFAC`` applies.

Per parameter the block is ``Q diag(vec S) Qᵀ`` with ``Q = Q_B ⊗ Q_A`` the eigenvectors of the
factors of :class:`~curvopt.linalg.KFAC` (accumulated over all of ``data``) and
``vec S = diag(Qᵀ EF Q)``, ``EF`` the empirical Fisher of all of ``data`` from the per-sample
gradients (extension ``EKFAC`` in the supplied bases ``Q``, one pass per batch; on the GGN's
scale: ``D Σ_n g_n g_nᵀ`` for "mean", ``D`` the loss's divisor, the sum for "sum").
Batches are weighted as in :mod:`curvopt.linalg.base`: batch ``b`` contributes ``S_b = D_b
Σ_{n∈b} (Q_Bᵀ G_n Q_A)²`` ("mean", weight ``R_b / R``, its share of the loss rows) or
``Σ_{n∈b} (...)²`` ("sum"), the optimizer's correction of that batch. With one loss term per
sample (``D = N``: a classifier's cross-entropy) it is the projection of
:class:`~curvopt.linalg.EmpiricalFisher` onto the matrices diagonal in ``Q``.
"""

from __future__ import annotations

from curvopt import extensions, optim
from curvopt.linalg.base import BlockDiagonal, CurvatureOperator
from curvopt.linalg.collected import collected
from curvopt.linalg.kronecker import KFAC
from curvopt.optim.eigen_corrected import as_rows, eigen_corrected_matmul, kron_basis
from curvopt.optim.stages.precondition import damped_inverse


def _block(bases, apply):
    """``V [K, *p.shape] ↦ apply(V as [K, dim B, ·] matrices)``, reshaped back."""
    return lambda v: apply(as_rows(v, bases, leading=1)).reshape(v.shape)


class EKFAC(CurvatureOperator):
    """Block diagonal ``diag(Q_i diag(S_i) Q_iᵀ)`` (two passes over ``data`` at construction:
    the factors, then ``S`` in their eigenbasis). ``self.bases[i]`` is ``[Q_B, Q_A]`` (``[Q_B]``)
    and ``self.corrections[i]`` the ``[dim B, dim A]`` matrix ``S`` of parameter ``i``."""

    def __init__(self, model, lossfunc, data, curvature: str = "kfac", seed: int = 0, mc_samples=1):
        if curvature not in ("kfac", "kflr"):
            raise ValueError(f"EKFAC: curvature must be 'kfac' or 'kflr', got {curvature!r}")
        kfac = KFAC(model, lossfunc, data, curvature, seed, mc_samples)
        super().__init__(model, lossfunc, data)
        self.bases = [kron_basis(fs) for fs in kfac.factors]

        supplied = extensions.EKFAC(bases=dict(zip(self.params, self.bases)))
        self.corrections = self._sum(
            (rows, [value[0] for value in values])
            for rows, values in collected(self, supplied, seed)
        )
        self.matrix = BlockDiagonal(
            self.params,
            [
                _block(bs, lambda m, bs=bs, s=s: eigen_corrected_matmul(bs, s, m))
                for bs, s in zip(self.bases, self.corrections)
            ],
        )

    def _sum(self, pairs):
        """Per parameter, ``weighted_sum`` of the batches' corrections."""
        batches = list(pairs)
        return [
            self.weighted_sum((rows, values[i]) for rows, values in batches)
            for i in range(len(self.params))
        ]

    def _apply(self, matrix):
        return self.matrix._apply(matrix)

    def inverse(self, damping: float) -> BlockDiagonal:
        """``(Q diag(S) Qᵀ + λ I)⁻¹`` by ``optim.EKFAC``'s own preconditioning (the precondition
        stage)."""
        optimizer = optim.EKFAC(self.params, 1.0, damping)
        return BlockDiagonal(
            self.params,
            [
                damped_inverse(optimizer, p, [s, *bs], damping)
                for p, bs, s in zip(self.params, self.bases, self.corrections)
            ],
        )
