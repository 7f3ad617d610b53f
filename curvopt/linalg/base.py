"""``CurvatureOperator``: a ``(P, P)`` ``scipy.sparse.linalg.LinearOperator`` over a data set.

``P`` counts the entries of the trainable parameters, ordered as ``model.parameters()``, each
``vec(p)`` row-major. Vectors cross the boundary as numpy arrays and are computed on as torch
tensors of the model's dtype and device. Curvature over batches ``b`` is ``C = (1/D) Σ_b D_b
C_b`` for ``reduction="mean"`` and ``C = Σ_b C_b`` for ``"sum"``, ``D_b`` the divisor of batch
``b``'s loss (``LossRule.divisor``: its rows ``R_b`` (dim 0 of the loss input) for one term per
row, the counted rows with ``ignore_index``, their class weights' sum, ``R_b·K`` for ``K``
outputs per row) and ``D = Σ_b D_b``: ``C_b`` is ``(1/D_b)`` times its terms, so ``C`` is the
matrix of the loss on all of the data as one batch. (``EmpiricalFisher``, scaled per batch by
its rows, weighs batches by ``R_b``.)

Inputs may be a tensor, a tuple or a dict (``model(**inputs)``, Hugging Face style), and
``output=`` picks the tensor of the model's output the loss takes (default: the output, or the
``.logits`` of a ``ModelOutput``); see :mod:`curvopt.core.inputs`. The loss must take that tensor
as it is (e.g. a language model's logits flattened by ``output=lambda o: o.logits.flatten(0, 1)``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import torch
from scipy.sparse.linalg import LinearOperator
from torch import nn

from curvopt.core import inputs as io
from curvopt.errors import MissingLossError
from curvopt.core.extended import is_extended
from curvopt.losses import loss_rule_for

Batch = tuple[torch.Tensor, torch.Tensor]


def check_extended(model: nn.Module, lossfunc: nn.Module) -> None:
    """Raise unless ``curvopt.extend`` was applied to ``model`` (all trainable parameters) and
    to ``lossfunc``, and the loss is one curvopt supports (``UnsupportedLossError`` otherwise)."""
    if not is_extended(lossfunc):
        raise MissingLossError(
            f"curvopt.linalg: the loss {type(lossfunc).__name__} is not extended; "
            "call lossfunc = curvopt.extend(lossfunc) first"
        )
    loss_rule_for(lossfunc)
    missing = [n for n, p in model.named_parameters() if p.requires_grad and not is_extended(p)]
    if missing:
        raise ValueError(
            f"curvopt.linalg: the model is not extended (parameters {missing[:3]} have no "
            "curvopt hooks); call model = curvopt.extend(model) first"
        )


class ParameterOperator(LinearOperator):
    """A symmetric ``(P, P)`` operator on the flattened ``params``: numpy in and out, computed
    in torch (the parameters' dtype and device) by :meth:`_apply` on ``V [P, K]``."""

    def __init__(self, params: list[torch.Tensor]):
        self.params = params
        self.torch_dtype = params[0].dtype
        self.device = params[0].device
        size = sum(p.numel() for p in params)
        numpy_dtype = torch.empty(0, dtype=self.torch_dtype).numpy().dtype
        super().__init__(dtype=numpy_dtype, shape=(size, size))

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """``[P, K] -> [[K, *p.shape] per parameter]``."""
        chunks = flat.split([p.numel() for p in self.params])
        return [c.T.reshape(-1, *p.shape) for c, p in zip(chunks, self.params)]

    @staticmethod
    def join(tensors: list[torch.Tensor]) -> torch.Tensor:
        """Inverse of :meth:`split`: ``[[K, *p.shape]] -> [P, K]``."""
        return torch.cat([t.flatten(1) for t in tensors], 1).T

    def _apply(self, matrix: torch.Tensor) -> torch.Tensor:
        """``C V`` for ``V [P, K]`` (torch)."""
        raise NotImplementedError

    def _matmat(self, matrix):
        matrix = torch.as_tensor(np.asarray(matrix), dtype=self.torch_dtype, device=self.device)
        result = self._apply(matrix.reshape(self.shape[0], -1))
        return result.detach().cpu().numpy()

    def _matvec(self, vector):
        return self._matmat(np.asarray(vector).reshape(-1, 1)).reshape(-1)

    def _adjoint(self):
        return self  # every curvature here is symmetric

    def to_dense(self) -> np.ndarray:
        """The ``(P, P)`` matrix (``P`` products; for small models and tests)."""
        return self @ np.eye(self.shape[0], dtype=self.dtype)


class BlockDiagonal(ParameterOperator):
    """``diag(C_1, ..., C_m)`` with one block per parameter, ``blocks[i]`` mapping
    ``[K, *p_i.shape]`` to ``[K, *p_i.shape]``."""

    def __init__(self, params: list[torch.Tensor], blocks: list[Callable]):
        super().__init__(params)
        self.blocks = blocks

    def _apply(self, matrix):
        parts = self.split(matrix)
        return self.join([block(part) for block, part in zip(self.blocks, parts)])


class CurvatureOperator(ParameterOperator):
    """Base class of the curvature operators: a symmetric ``(P, P)`` ``LinearOperator`` over data.

    ``P`` counts the entries of the trainable parameters, ordered as ``model.parameters()``,
    each ``vec(p)`` row-major; numpy in, numpy out (``op @ v``, ``op.matmat``,
    ``op.to_dense()``), computed in torch with the model's dtype and device. Over batches ``b``
    the matrix is ``C = (1/D) Σ_b D_b C_b`` for ``reduction="mean"``, ``D_b`` the divisor of
    batch ``b``'s loss and ``D = Σ_b D_b`` (as if ``data`` were one batch), and ``C = Σ_b C_b``
    for ``"sum"``. Subclasses
    implement ``_batch_matmat`` or override ``_apply``. Parameters and ``.grad`` are never
    changed.

    Args:
        model: the model, extended by ``curvopt.extend`` (its trainable parameters, in
            ``model.parameters()`` order, give ``P``).
        lossfunc: the loss module, extended, with ``reduction="mean"`` or ``"sum"``.
        data: a re-iterable of ``(input, target)`` batches (a list, a ``DataLoader``); inputs
            may be tensors, tuples or dicts (``model(**inputs)``).
        output: ``None`` (default: the model's output, or the ``.logits`` of a ``ModelOutput``)
            or a callable picking the tensor the loss takes from the model's output.

    Raises:
        MissingLossError: ``lossfunc`` is not extended.
        UnsupportedLossError: a loss curvopt does not support.
        ValueError: the model is not extended, has no trainable parameter, or ``data`` is
            empty.

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
        >>> G = linalg.GGN(model, lossfunc, data)
        >>> isinstance(G, linalg.CurvatureOperator), G.shape  # P = 2 * 3 + 2
        (True, (8, 8))
    """

    def __init__(self, model: nn.Module, lossfunc: nn.Module, data: Iterable[Batch], output=None):
        check_extended(model, lossfunc)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("curvopt.linalg: the model has no parameter that requires grad")
        if next(iter(data), None) is None:
            raise ValueError(
                "curvopt.linalg: data is empty; pass a re-iterable of (input, target) batches, "
                "e.g. a list or a DataLoader (not a generator that is already exhausted)"
            )
        super().__init__([p for _, p in named])
        self.model, self.lossfunc, self.data = model, lossfunc, data
        self.output = output  # which tensor of the model's output the loss takes
        self.names = [n for n, _ in named]

    @property
    def mean(self) -> bool:
        return self.lossfunc.reduction == "mean"

    def batches(self) -> Iterable[Batch]:
        """``data`` on the model's device, floating-point tensors in the model's dtype."""
        for inputs, targets in self.data:
            yield io.apply(self.to_model, inputs), self.to_model(targets)

    def to_model(self, t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            return t.to(self.device, self.torch_dtype)
        return t.to(self.device)

    def weight(self, output: torch.Tensor, targets) -> float:
        """``D_b``, batch ``b``'s weight in the mean over batches: its loss's divisor (the loss
        input ``output`` and ``targets`` of the batch)."""
        return loss_rule_for(self.lossfunc).divisor(self.lossfunc, output, targets)

    def weighted_sum(self, pairs: Iterable[tuple[float, torch.Tensor]]) -> torch.Tensor:
        """``Σ_b D_b C_b / D`` ("mean", as a running mean: one batch is returned as it is) or
        ``Σ_b C_b`` ("sum") over ``pairs`` ``(D_b, C_b)``."""
        total, seen = None, 0
        for weight, value in pairs:
            if total is None:
                total = value
            elif self.mean:
                total = total + (value - total) * (weight / (seen + weight))
            else:
                total = total + value
            seen += weight
        if total is None:
            raise ValueError("curvopt.linalg: data yielded no batch this time (exhausted?)")
        return total

    def _batch_matmat(self, inputs, targets, vectors: list[torch.Tensor]):
        """``(f_b, [C_b V per parameter])`` for ``vectors`` ``[[K, *p.shape]]``, ``f_b`` the
        batch's loss input (detached)."""
        raise NotImplementedError

    def _apply(self, matrix: torch.Tensor) -> torch.Tensor:
        """``C V`` for ``V [P, K]`` (torch)."""
        vectors = self.split(matrix)

        def pairs():
            for inputs, targets in self.batches():
                output, result = self._batch_matmat(inputs, targets, vectors)
                yield self.weight(output, targets), self.join(result)

        return self.weighted_sum(pairs())
