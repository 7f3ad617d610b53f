"""``KFAC``: curvopt's Kronecker factors over a data set, and the damped inverse ``optim.KFAC``
applies.

Per parameter the block is ``B ⊗ A`` (``[B]`` for one-dimensional parameters), indexed like
``vec(p)``. Over batches the output-side factor (built from the loss-Hessian columns, which
carry the reduction's scale) is summed with the weights of :mod:`curvopt.linalg.base`; the
input-side factor is a mean over inputs, so it is averaged with weights ``R_b / R``. A weight
used by several calls (an embedding tied to the output layer) is combined so call by call, and
its block is the nearest Kronecker product of the combined calls' sum
(``values.KroneckerFactors.sidewise``), that of one batch of all of ``data``. With one batch the
factors are those ``collect`` writes.
"""

from __future__ import annotations

import operator

from curvopt import extensions
from curvopt.linalg.base import BlockDiagonal, CurvatureOperator
from curvopt.linalg.collected import collected
from curvopt.inversion.kronecker import InverseOptions, KroneckerInverse, as_matrix, kron_matmul

#: the curvatures, by the attribute their extension writes (``curvopt.extensions.writer``)
_CURVATURES = ("kfac", "kflr", "kfra")


def _kron_block(rows: tuple, apply):
    """``V [K, *p.shape] ↦ apply(V as the matrices [K, *rows, ·])``, reshaped back (``rows``:
    ``(dim B,)``, or ``(G, dim B)`` for factors stacked per group)."""
    return lambda v: apply(v.reshape(v.shape[0], *rows, -1)).reshape(v.shape)


def _add(first, second):
    return first.sidewise(second, operator.add, operator.add)


def _rows(factors) -> tuple:
    return tuple(factors[0].shape[:-1])


class KFAC(CurvatureOperator):
    """curvopt's Kronecker factors on all of ``data``: the block diagonal ``diag(B_i ⊗ A_i)``.

    One block per parameter, ``kron(B, A)`` per weight and ``B`` per bias, indexed like
    ``vec(p)``, from ``p.kfac`` / ``p.kflr`` / ``p.kfra`` (one pass over ``data`` at
    construction). Over batches the output side ``B`` is summed with the weights of
    :class:`CurvatureOperator` and the input side ``A`` averaged with weights ``R_b / R``; with
    one batch the factors are those ``collect`` writes. ``self.factors[i]`` is the list of
    parameter ``i``. ``inverse(λ)`` is what ``optim.KFAC`` applies before its trust region
    scales the step.

    Args:
        model: the model, extended by ``curvopt.extend`` (its trainable parameters, in
            ``model.parameters()`` order, give ``P``).
        lossfunc: the loss module, extended, with ``reduction="mean"`` or ``"sum"``.
        data: a re-iterable of ``(input, target)`` batches (a list, a ``DataLoader``); inputs
            may be tensors, tuples or dicts (``model(**inputs)``).
        curvature: ``"kfac"`` (default, Monte-Carlo), ``"kflr"`` (exact) or ``"kfra"``.
        seed: the seed of the Monte-Carlo draws (default 0).
        mc_samples: Monte-Carlo samples for ``"kfac"`` (default 1).
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
        >>> K = linalg.KFAC(model, lossfunc, data, curvature="kflr")
        >>> [tuple(f.shape) for f in K.factors[0]]  # the weight's [B, A]
        [(2, 2), (3, 3)]
        >>> v = np.ones(8)
        >>> inverse = K.inverse(0.1, kronecker_damping="exact")
        >>> np.allclose(inverse @ (K @ v + 0.1 * v), v, atol=1e-5)
        True
    """

    def __init__(
        self, model, lossfunc, data, curvature="kfac", seed: int = 0, mc_samples=1, output=None
    ):
        super().__init__(model, lossfunc, data, output)
        if curvature not in _CURVATURES:
            raise ValueError(
                f"KFAC: curvature must be one of {', '.join(_CURVATURES)}, got {curvature!r}"
            )
        sums, rows, total = None, 0, 0
        batches = collected(self, extensions.extension(curvature, mc_samples), seed)
        for count, weight, values in batches:
            weighted = [
                self._weighted(fs, lambda f, w: f.detach() * w, count, weight) for fs in values
            ]
            sums = weighted if sums is None else [_add(s, w) for s, w in zip(sums, weighted)]
            rows, total = rows + count, total + weight
        self.factors = [self._weighted(fs, lambda f, w: f / w, rows, total) for fs in sums]
        for p, factors in zip(self.params, self.factors):
            as_matrix(p.detach(), factors)
        self.matrix = BlockDiagonal(
            self.params,
            [_kron_block(_rows(fs), lambda m, fs=fs: kron_matmul(fs, m)) for fs in self.factors],
        )

    def _weighted(self, factors, weigh, rows: int, weight: float):
        """``weigh(F, w)`` for each factor with the batch weight (and final divisor) ``w``: the
        input side averages over samples, ``R_b`` (``R``); the output side
        (``values.KroneckerFactors``) carries the loss's ``1/D_b``, ``D_b`` (``D``) under
        ``"mean"`` (``CurvatureOperator.weight``), 1 under ``"sum"``."""
        output_weight = weight if self.mean else 1
        return factors.sidewise(
            factors, lambda f, _: weigh(f, output_weight), lambda f, _: weigh(f, rows)
        )

    def _apply(self, matrix):
        return self.matrix._apply(matrix)

    def inverse(self, damping: float, kronecker_damping: str = "trace_norm") -> BlockDiagonal:
        """The damped inverse of the Kronecker blocks, by ``optim.KFAC``'s own preconditioning.

        Args:
            damping: ``λ``.
            kronecker_damping: ``"trace_norm"`` (default) inverts ``(B + √λ/π I) ⊗ (A + π√λ I)``
                with ``π = sqrt((tr A / dim A) / (tr B / dim B))``; ``"exact"`` inverts
                ``B ⊗ A + λ I``.

        Returns:
            A ``(P, P)`` ``LinearOperator``.

        Raises:
            ValueError: an unknown ``kronecker_damping``.
        """
        if kronecker_damping not in ("trace_norm", "exact"):
            raise ValueError(
                f"KFAC.inverse: kronecker_damping must be 'trace_norm' or 'exact', got "
                f"{kronecker_damping!r}"
            )
        options = InverseOptions(kronecker_damping)
        return BlockDiagonal(
            self.params,
            [KroneckerInverse.build(fs, damping, options).apply for fs in self.factors],
        )
