"""The typed values of the quantities ``collect`` writes, and what each part of one means.

``p.<attr>`` is the value itself: the list or tensor the contract describes. Its type says what
a consumer must not re-derive from the attribute's name or a factor's position:

* :class:`KroneckerFactors` ``[F_0, F_1]`` (``[B]`` for one-dimensional parameters), in
  ``vec(p)``'s dim order, knowing which factor is the **output side** (built from the loss's
  columns: it carries the loss scale and adds over micro-batches) and which the **input side**
  (a mean over inputs). The output side is ``F_0`` for ``Linear``/conv weights, ``F_1`` for
  ``Embedding`` and Hugging Face's ``Conv1D`` (their rules' ``output_factor_index``);
* :class:`EigenCorrected` ``[S, *bases]``: ``S`` carries the loss scale, the bases do not;
* a tensor (per-sample, summed, moment): carries the loss scale as a whole.

Each carries the loss scale to its quantity's power (``Quantity.loss_scale_power``), so
:func:`unscaled` is the one place that divides a value by a loss scale; :func:`read` the one
place where consumers read a value from a parameter.
"""

from __future__ import annotations

from typing import Callable, Sequence, Union

import torch

from curvopt.extensions.quantity import Kind, Quantity
from curvopt.engine.reductions import gram_root


def rescaled(factor: torch.Tensor, scale: float, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``scale · F`` (a new tensor, in ``dtype`` if given) that keeps ``F``'s Gram root as
    ``√scale · U`` (``reductions.gram_root``), so the Woodbury form stays available."""
    dtype = factor.dtype if dtype is None else dtype
    result = factor.to(dtype) * scale
    root = gram_root(factor)
    if root is not None:
        result.gram_root = root.to(dtype) * scale**0.5
    return result


class KroneckerFactors(list):
    """``[F_0, F_1]`` (or ``[B]``) with ``kron(*factors)`` indexed like ``vec(p)``;
    ``output_index``: the position of the output-side factor."""

    def __init__(self, factors: Sequence[torch.Tensor] = (), output_index: int = 0):
        super().__init__(factors)
        self.output_index = output_index

    @property
    def output_side(self) -> torch.Tensor:
        return self[self.output_index]

    def replaced(self, factors: Sequence[torch.Tensor]) -> "KroneckerFactors":
        """The same sides with other factors (in the same order)."""
        return KroneckerFactors(factors, self.output_index)

    def sidewise(
        self, other: Sequence[torch.Tensor], output: Callable, input: Callable
    ) -> "KroneckerFactors":
        """``output(F, G)`` for the output-side pair of ``self`` and ``other``,
        ``input(F, G)`` for the input-side pairs."""
        return self.replaced(
            [
                (output if i == self.output_index else input)(f, g)
                for i, (f, g) in enumerate(zip(self, other))
            ]
        )

    def divided(self, divisor: float) -> "KroneckerFactors":
        """The output side divided by ``divisor`` (Gram roots kept), the input sides as they are."""
        return self.sidewise(self, lambda f, _: rescaled(f, 1 / divisor), lambda f, _: f)


class EigenCorrected(list):
    """``[S, *bases]``: the corrected eigenvalues ``S`` in the eigenbases ``Q_0, Q_1``."""

    @property
    def eigenvalues(self) -> torch.Tensor:
        return self[0]

    @property
    def bases(self) -> list:
        return list(self[1:])

    def replaced(self, items: Sequence[torch.Tensor]) -> "EigenCorrected":
        return EigenCorrected(items)

    def divided(self, divisor: float) -> "EigenCorrected":
        """``S`` divided by ``divisor``, the bases as they are."""
        return EigenCorrected([self.eigenvalues / divisor, *self.bases])


Value = Union[torch.Tensor, KroneckerFactors, EigenCorrected, tuple]

_LISTS = {Kind.FACTORS: KroneckerFactors, Kind.EIGEN_CORRECTED: EigenCorrected}


def read(param: torch.Tensor, attr: str):
    """``param.<attr>`` as ``collect`` (or the user) set it, or ``None``: the one place where
    consumers read a quantity from a parameter."""
    return getattr(param, attr, None)


def typed(q: Quantity, value):
    """``value`` of ``p.<q.attr>`` as its typed value: itself where it is one (what ``collect``
    writes) or a tensor; a plain list (set by hand) in the contract's order, the output side
    first."""
    kind = _LISTS.get(q.kind)
    if kind is None or isinstance(value, kind):
        return value
    return kind(value)


def unscaled(q: Quantity, value, scale: float | None):
    """``value`` of ``p.<q.attr>`` from a pass whose loss was multiplied by ``scale``, divided
    by ``scale`` to the quantity's power where it carries it (``None``: ``value`` itself)."""
    if scale is None:
        return value
    divisor = scale**q.loss_scale_power
    value = typed(q, value)
    if isinstance(value, torch.Tensor):
        return value / divisor
    return value.divided(divisor)


def plain(value):
    """``value`` without its type (a list of its tensors, or the tensor): what optimizer state
    keeps, so that ``state_dict()`` holds only torch's own types."""
    return value if isinstance(value, torch.Tensor) else list(value)
