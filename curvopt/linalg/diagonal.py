"""``Diagonal``: curvopt's curvature diagonals over a data set, and their damped inverse."""

from __future__ import annotations

import torch

from curvopt import extensions
from curvopt.linalg.base import BlockDiagonal, CurvatureOperator
from curvopt.linalg.collected import collected
from curvopt.inversion.inverses import DiagonalInverse

#: ``curvature=`` -> the attribute its extension writes (``curvopt.extensions.writer``)
_CURVATURES = {"ggn_exact": "diag_ggn_exact", "ggn_mc": "diag_ggn_mc", "hessian": "diag_h"}


class Diagonal(CurvatureOperator):
    """curvopt's curvature diagonal on all of ``data`` as a ``(P, P)`` operator ``diag(c)``.

    ``c`` is ``p.diag_ggn_exact``, ``p.diag_ggn_mc`` or ``p.diag_h`` of every parameter,
    flattened and concatenated, summed over batches with the weights of
    :class:`CurvatureOperator` (one pass over ``data`` at construction). ``inverse(λ)`` is
    ``(diag(c) + λ I)⁻¹``, what ``optim.DiagGGNNewton`` applies.

    Args:
        model: the model, extended by ``curvopt.extend`` (its trainable parameters, in
            ``model.parameters()`` order, give ``P``).
        lossfunc: the loss module, extended, with ``reduction="mean"`` or ``"sum"``.
        data: a re-iterable of ``(input, target)`` batches (a list, a ``DataLoader``); inputs
            may be tensors, tuples or dicts (``model(**inputs)``).
        curvature: ``"ggn_exact"`` (default, ``DiagGGNExact``), ``"ggn_mc"`` (``DiagGGNMC``) or
            ``"hessian"`` (``DiagHessian``).
        seed: the seed of the Monte-Carlo draws (default 0).
        mc_samples: Monte-Carlo samples for ``"ggn_mc"`` (default 1).
        output: ``None`` (default: the model's output, or the ``.logits`` of a ``ModelOutput``)
            or a callable picking the tensor the loss takes from the model's output.

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
        >>> D = linalg.Diagonal(model, lossfunc, data, curvature="ggn_exact")
        >>> G = linalg.GGN(model, lossfunc, data)
        >>> np.allclose(D @ np.ones(8), np.diag(G.to_dense()), atol=1e-6)
        True
        >>> v = np.ones(8)
        >>> np.allclose(D.inverse(0.1) @ (D @ v + 0.1 * v), v, atol=1e-5)
        True
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
            (weight, torch.cat([v.detach().flatten() for v in values]))
            for _, weight, values in collected(self, extension, seed)
        )

    def _apply(self, matrix):
        return self.diagonal[:, None] * matrix

    def inverse(self, damping: float) -> BlockDiagonal:
        """The damped inverse ``(diag(c) + λ I)⁻¹``, as ``optim.DiagGGNNewton`` preconditions.

        Args:
            damping: ``λ``.

        Returns:
            A ``(P, P)`` ``LinearOperator`` applying ``g / (c + λ)``.
        """
        diagonals = self.diagonal.split([p.numel() for p in self.params])
        return BlockDiagonal(
            self.params,
            [
                DiagonalInverse.build(c.view(p.shape), damping).apply
                for p, c in zip(self.params, diagonals)
            ],
        )
