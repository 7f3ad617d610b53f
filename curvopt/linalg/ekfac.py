"""``EKFAC``: eigenvalue-corrected Kronecker curvature over a data set, and the damped inverse
``optim.EKFAC`` applies.

Per parameter the block is ``Q diag(vec S) Qᵀ`` with ``Q = Q_B ⊗ Q_A`` the eigenvectors of the
factors of :class:`~curvopt.linalg.KFAC` (accumulated over all of ``data``) and
``vec S = diag(Qᵀ EF Q)``, ``EF`` the empirical Fisher of all of ``data`` from the per-sample
gradients (extension ``EKFAC`` in the supplied bases ``Q``, one pass per batch; on the GGN's
scale: ``D Σ_n g_n g_nᵀ`` for "mean", ``D`` the loss's divisor, the sum for "sum").
Batches are weighted as in :mod:`curvopt.linalg.base`: batch ``b`` contributes ``S_b = D_b
Σ_{n∈b} (Q_Bᵀ G_n Q_A)²`` ("mean", weight ``D_b / D``, its share of the loss's divisor) or
``Σ_{n∈b} (...)²`` ("sum"), the optimizer's correction of that batch. With one loss term per
sample (``D = N``: a classifier's cross-entropy) it is the projection of
:class:`~curvopt.linalg.EmpiricalFisher` onto the matrices diagonal in ``Q``.
"""

from __future__ import annotations

from curvopt import extensions
from curvopt.linalg.base import BlockDiagonal, CurvatureOperator
from curvopt.linalg.collected import collected
from curvopt.linalg.kronecker import KFAC
from curvopt.inversion.eigen_corrected import as_rows, eigen_corrected_matmul, kron_basis
from curvopt.inversion.inverses import EigenCorrectedInverse


def _block(bases, apply):
    """``V [K, *p.shape] ↦ apply(V as [K, dim B, ·] matrices)``, reshaped back."""
    return lambda v: apply(as_rows(v, bases, leading=1)).reshape(v.shape)


class EKFAC(CurvatureOperator):
    """Eigenvalue-corrected Kronecker curvature on all of ``data``: ``diag(Q_i diag(S_i) Q_iᵀ)``.

    ``Q = Q_B ⊗ Q_A`` are the eigenvectors of the factors of :class:`KFAC` (accumulated over
    all of ``data``) and ``vec S = diag(Qᵀ EF Q)``, ``EF`` the empirical Fisher of all of
    ``data`` on the GGN's scale (two passes over ``data`` at construction: the factors, then
    ``S`` in their eigenbasis). ``self.bases[i]`` is ``[Q_B, Q_A]`` (``[Q_B]``) and
    ``self.corrections[i]`` the ``[dim B, dim A]`` matrix ``S`` of parameter ``i``.
    ``inverse(λ)`` is what ``optim.EKFAC`` applies.

    Args:
        model: the model, extended by ``curvopt.extend`` (its trainable parameters, in
            ``model.parameters()`` order, give ``P``).
        lossfunc: the loss module, extended, with ``reduction="mean"`` or ``"sum"``.
        data: a re-iterable of ``(input, target)`` batches (a list, a ``DataLoader``); inputs
            may be tensors, tuples or dicts (``model(**inputs)``).
        curvature: the factors giving the bases: ``"kfac"`` (default) or ``"kflr"``.
        seed: the seed of the Monte-Carlo draws (default 0).
        mc_samples: Monte-Carlo samples for ``"kfac"`` (default 1).

    Raises:
        MissingLossError: ``lossfunc`` is not extended.
        UnsupportedLossError: a loss curvopt does not support.
        ValueError: an unknown ``curvature``, the model is not extended, has no trainable
            parameter, or ``data`` is empty.

    Example:
        >>> import numpy as np, torch, curvopt
        >>> from curvopt import linalg
        >>> _ = torch.manual_seed(0)
        >>> model = curvopt.extend(torch.nn.Sequential(torch.nn.Linear(3, 2)))
        >>> lossfunc = curvopt.extend(torch.nn.CrossEntropyLoss())
        >>> data = [
        ...     (torch.randn(4, 3), torch.tensor([0, 1, 1, 0])),
        ...     (torch.randn(2, 3), torch.tensor([1, 0])),
        ... ]
        >>> E = linalg.EKFAC(model, lossfunc, data, curvature="kflr")
        >>> E.corrections[0].shape  # S of the weight
        torch.Size([2, 3])
        >>> v = np.ones(8)
        >>> np.allclose(E.inverse(0.1) @ (E @ v + 0.1 * v), v, atol=1e-5)
        True
    """

    def __init__(self, model, lossfunc, data, curvature: str = "kfac", seed: int = 0, mc_samples=1):
        if curvature not in ("kfac", "kflr"):
            raise ValueError(f"EKFAC: curvature must be 'kfac' or 'kflr', got {curvature!r}")
        kfac = KFAC(model, lossfunc, data, curvature, seed, mc_samples)
        super().__init__(model, lossfunc, data)
        self.bases = [kron_basis(fs) for fs in kfac.factors]

        supplied = extensions.EKFAC(bases=dict(zip(self.params, self.bases)))
        self.corrections = self._sum(
            (weight, [value[0] for value in values])
            for _, weight, values in collected(self, supplied, seed)
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
            self.weighted_sum((weight, values[i]) for weight, values in batches)
            for i in range(len(self.params))
        ]

    def _apply(self, matrix):
        return self.matrix._apply(matrix)

    def inverse(self, damping: float) -> BlockDiagonal:
        """The damped inverse ``(Q diag(S) Qᵀ + λ I)⁻¹``, by ``optim.EKFAC``'s own preconditioning.

        Args:
            damping: ``λ``.

        Returns:
            A ``(P, P)`` ``LinearOperator``.
        """
        return BlockDiagonal(
            self.params,
            [
                EigenCorrectedInverse.build([s, *bs], damping).apply
                for bs, s in zip(self.bases, self.corrections)
            ],
        )
