"""``Diagonal``: curvopt's curvature diagonals over a data set, and their damped inverse."""

from __future__ import annotations

import torch

from curvopt import extensions
from curvopt.linalg.base import BlockDiagonal, CurvatureOperator
from curvopt.linalg.collected import collected
from curvopt.optim.inverses import DiagonalInverse

#: ``curvature=`` -> the attribute its extension writes (``curvopt.extensions.writer``)
_CURVATURES = {"ggn_exact": "diag_ggn_exact", "ggn_mc": "diag_ggn_mc", "hessian": "diag_h"}


class Diagonal(CurvatureOperator):
    """``diag(c)``: ``c`` from ``DiagGGNExact`` / ``DiagGGNMC`` / ``DiagHessian``, summed over
    batches with the weights of :mod:`curvopt.linalg.base` (one pass over ``data`` at
    construction). ``inverse(λ)`` is ``(diag(c) + λ I)⁻¹``, the step of ``optim.DiagGGNNewton``.
    """

    def __init__(
        self,
        model,
        lossfunc,
        data,
        curvature: str = "ggn_exact",
        seed: int = 0,
        mc_samples=1,
        output=None,
    ):
        super().__init__(model, lossfunc, data, output)
        if curvature not in _CURVATURES:
            raise ValueError(
                f"Diagonal: curvature must be one of {', '.join(_CURVATURES)}, got {curvature!r}"
            )
        extension = extensions.extension(_CURVATURES[curvature], mc_samples)

        self.diagonal = self.weighted_sum(
            (rows, torch.cat([v.detach().flatten() for v in values]))
            for rows, values in collected(self, extension, seed)
        )

    def _apply(self, matrix):
        return self.diagonal[:, None] * matrix

    def inverse(self, damping: float) -> BlockDiagonal:
        """``(diag(c) + λ I)⁻¹`` by ``optim.DiagGGNNewton``'s own preconditioning (the
        ``optim.inverses``: ``g / (c + λ)``)."""
        diagonals = self.diagonal.split([p.numel() for p in self.params])
        return BlockDiagonal(
            self.params,
            [
                DiagonalInverse.build(c.view(p.shape), damping).apply
                for p, c in zip(self.params, diagonals)
            ],
        )
