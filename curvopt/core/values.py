"""The typed values of the quantities ``collect`` writes, and what each part of one means.

``p.<attr>`` is the value itself: the list or tensor the contract describes. Its type says what
a consumer must not re-derive from the attribute's name or a factor's position:

* :class:`KroneckerFactors` ``[F_0, F_1]`` (``[B]`` for one-dimensional parameters), in
  ``vec(p)``'s dim order, knowing which factor is the **output side** (built from the loss's
  columns: it carries the loss scale and adds over micro-batches) and which the **input side**
  (a mean over inputs). The output side is ``F_0`` for ``Linear``/conv weights, ``F_1`` for
  ``Embedding`` and Hugging Face's ``Conv1D`` (their rules' ``output_factor_index``). A weight
  used by several calls (a reused module, an embedding tied to the output layer) keeps each
  call's factors (``uses``); its list is their nearest Kronecker product
  (:func:`nearest_kronecker`), which does not add over micro-batches, so values combine use by
  use and the product is made again from the combined uses;
* :class:`EigenCorrected` ``[S, *bases]``: ``S`` carries the loss scale, the bases do not;
* a tensor (per-sample, summed, moment): carries the loss scale as a whole.

Each carries the loss scale to its quantity's power (``Quantity.loss_scale_power``), so
:func:`unscaled` is the one place that divides a value by a loss scale; :func:`read` the one
place where consumers read a value from a parameter.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence, Union

import torch

from curvopt.errors import AccumulationError
from curvopt.extensions.quantity import Kind, Quantity
from curvopt.core.reductions import gram_root


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
    ``output_index``: the position of the output-side factor.

    ``uses``: for a weight used by several calls, each call's own factors ``[F_0^i, F_1^i]``
    (each knowing its output side, which may stand elsewhere: an ``Embedding``'s ``F_1``, a
    tied ``Linear``'s ``F_0``), by call name in forward order (:meth:`of_uses`); ``None``
    for one call, and for a one-dimensional parameter, whose uses add exactly. The list is then
    made from them: ``nearest_kronecker`` of ``sum_i kron(F_0^i, F_1^i)``. Over passes each
    use's factors combine as one call's do (:meth:`sidewise`: ``B_i`` adds, ``A_i`` averages
    over samples), so the product made from them is that of one batch of all the samples; the
    products of each pass's sums would not add (``||·||_F``'s best rank-one term is not linear)."""

    def __init__(
        self,
        factors: Sequence[torch.Tensor] = (),
        output_index: int = 0,
        uses: Optional[Dict[str, "KroneckerFactors"]] = None,
    ):
        super().__init__(factors)
        self.output_index = output_index
        self.uses = uses

    @staticmethod
    def of_uses(uses: Dict[str, "KroneckerFactors"]) -> "KroneckerFactors":
        """The factors of a parameter used by the calls ``uses`` (name ``->`` that call's
        factors, in forward order): one call's own; several calls' nearest Kronecker product
        (``output_index`` the first call's, as is the side whose trace is kept: its input
        side), with the uses kept where the parameter has two dims."""
        terms = list(uses.values())
        first = terms[0]
        if len(terms) == 1:
            return first
        factors = nearest_kronecker(terms, 1 - first.output_index)
        return KroneckerFactors(factors, first.output_index, uses if len(first) > 1 else None)

    @property
    def output_side(self) -> torch.Tensor:
        return self[self.output_index]

    def replaced(self, factors: Sequence[torch.Tensor]) -> "KroneckerFactors":
        """The same sides with other factors (in the same order); no uses."""
        return KroneckerFactors(factors, self.output_index)

    def sidewise(
        self, other: "KroneckerFactors", output: Callable, input: Callable
    ) -> "KroneckerFactors":
        """``output(F, G)`` for the output-side pair of ``self`` and ``other``,
        ``input(F, G)`` for the input-side pairs; with ``uses``, for each call's pairs (the
        calls of ``self`` and ``other`` must be the same), the nearest Kronecker product made
        again from the results (:meth:`of_uses`)."""
        if self.uses is None and other.uses is None:
            return self.replaced(
                [
                    (output if i == self.output_index else input)(f, g)
                    for i, (f, g) in enumerate(zip(self, other))
                ]
            )
        calls, others = list(self.uses or ("one call",)), list(other.uses or ("one call",))
        if calls != others:
            raise AccumulationError(
                f"the Kronecker factors of a weight used by the calls {calls} do not combine "
                f"with those of the calls {others} (a nearest Kronecker product combines only use "
                "by use). Use it in the same calls in every backward pass combined, or run one "
                "pass per collect; see docs/support.md#several-backward-passes."
            )
        return KroneckerFactors.of_uses(
            {name: use.sidewise(other.uses[name], output, input) for name, use in self.uses.items()}
        )

    def divided(self, divisor: float) -> "KroneckerFactors":
        """The output side divided by ``divisor`` (Gram roots kept), the input sides as they
        are (``kron`` divided by ``divisor``); no uses."""
        return self.replaced(
            [rescaled(f, 1 / divisor) if i == self.output_index else f for i, f in enumerate(self)]
        )


def nearest_kronecker(terms, input_side: int):
    """Factors ``[F0, F1]`` whose ``kron`` is nearest in Frobenius norm to
    ``sum_i kron(F0_i, F1_i)``: the factors of a weight used by several calls (a reused module,
    a weight tied across modules), each use's cross terms with the others ignored, as KFAC
    ignores them between positions (Van Loan & Pitsianis, 1993).

    Rearranged (``kron(B, A) -> vec(B) vec(A)^T``) the sum is ``U V^T`` with ``U = [vec F0_i]``,
    ``V = [vec F1_i]``, and its best rank-one term comes from the SVD of the ``m x m`` matrix
    ``R_U R_V^T`` of their QR factors. The Gram matrices of PSD factors are entrywise positive,
    so the leading singular vectors are too and both factors are PSD. The scale is split so that
    the factor at ``input_side`` has the mean trace of the uses' factors there. One-dimensional
    parameters (``[B]`` per use) add exactly; factors stacked per group (``[G, d, d]``, a grouped
    convolution's) give each group's nearest product.
    """
    if len(terms[0]) == 1:
        return [sum(t[0] for t in terms)]
    if terms[0][0].dim() == 3:
        groups = [
            nearest_kronecker([[f[g] for f in t] for t in terms], input_side)
            for g in range(terms[0][0].shape[0])
        ]
        return [torch.stack(blocks) for blocks in zip(*groups)]
    u = torch.stack([t[0].flatten() for t in terms], 1)
    v = torch.stack([t[1].flatten() for t in terms], 1)
    qu, ru = torch.linalg.qr(u)
    qv, rv = torch.linalg.qr(v)
    left, values, right = torch.linalg.svd(ru @ rv.T)
    f0 = (qu @ left[:, 0]).reshape(terms[0][0].shape)
    f1 = (qv @ right[0]).reshape(terms[0][1].shape)
    if torch.trace(f0) < 0:
        f0, f1 = -f0, -f1
    factors = [f0, f1 * values[0]]
    wanted = sum(torch.trace(t[input_side]) for t in terms) / len(terms)
    ratio = wanted / torch.trace(factors[input_side])
    factors[input_side] = factors[input_side] * ratio
    factors[1 - input_side] = factors[1 - input_side] / ratio
    return factors


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
