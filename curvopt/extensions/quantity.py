"""What each quantity is: its declaration, and the one lookup by attribute name.

Every quantity ``collect`` writes as ``p.<attr>`` is declared once, as a :class:`Quantity`:

* ``kind``: per-sample (``[N, ...]``), summed over samples, a moment-derived statistic, or
  Kronecker factors;
* ``combine``: how the results of several backward passes in one ``collect`` (micro-batches)
  combine, as if all samples had been one batch. A required field without a default, so a
  quantity cannot be declared without saying it (it would otherwise be silently summed);
* ``producer``: which part of the engine computes it (see :class:`Producer`), and so the power
  of a loss scale its values carry (``loss_scale_power``);
* ``reference``: for first-order quantities, the value as a function of the per-sample
  gradients ``G`` (``[N, *p.shape]``), the definition ``verify`` checks against.

Engine code asks the declaration (``quantity(attr)``), never the attribute's name.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Dict, Optional

import torch


class Kind(enum.Enum):
    """What the value of a quantity is, one member per kind.

    Attributes:
        PER_SAMPLE: one entry per sample, ``[N, ...]`` (``grad_batch``, ``batch_l2``, ...).
        SUMMED: a sum over samples, ``p.shape`` (``sum_grad_squared``, ``diag_ggn_exact``, ...).
        MOMENT: a statistic of the moments over samples (``variance``).
        FACTORS: a list of Kronecker factors (``kfac``, ``kflr``, ...).
        EIGEN_CORRECTED: ``[S, *bases]``, eigenvalues in Kronecker eigenbases (``ekfac``).

    Example:
        >>> from curvopt import extensions as ext
        >>> ext.quantity("grad_batch").kind
        <Kind.PER_SAMPLE: 'one entry per sample, [N, ...]'>
    """

    PER_SAMPLE = "one entry per sample, [N, ...]"
    SUMMED = "a sum over samples"
    MOMENT = "a statistic of the moments over samples"
    FACTORS = "a list of Kronecker factors (values.KroneckerFactors)"
    EIGEN_CORRECTED = "[S, *bases]: eigenvalues in Kronecker eigenbases (values.EigenCorrected)"

    #: the identity hash, as :class:`Producer`'s (a pass looks kinds up per parameter written)
    __hash__ = object.__hash__


class Combine(enum.Enum):
    """How the values of two backward passes (over ``N_1`` and ``N_2`` samples) combine.

    Several passes in one ``collect`` (micro-batches) combine as if all samples had been one
    batch.

    Attributes:
        CONCATENATE: concatenated along the batch (per-sample quantities).
        ADD: added (summed quantities).
        MOMENTS: recomputed from the summed moments ``(Σ g², Σ g)`` and ``N_1 + N_2``.
        FACTORS: output-side factor added, input-side factors averaged with weights ``N_i``.
        RAISES: does not combine (neither over passes nor over several calls): raises.
        SAME_BASIS: ``[S, *bases]``: ``S`` added where both passes used the same supplied
            bases, else raises.

    Example:
        >>> from curvopt import extensions as ext
        >>> ext.quantity("kfra").combine is ext.Combine.RAISES
        True
    """

    CONCATENATE = "concatenated along the batch"
    ADD = "added"
    MOMENTS = "recomputed from the summed moments (sum g^2, sum g) and N_1 + N_2"
    FACTORS = "output-side factor added, input-side factors averaged with weights N_i"
    RAISES = "does not combine (neither over passes nor over several calls): raises"
    SAME_BASIS = (
        "[S, *bases]: S added where both passes used the same (supplied) bases, else raises"
    )

    #: the identity hash, as :class:`Producer`'s (a pass looks combine rules up per parameter)
    __hash__ = object.__hash__


class Producer(enum.Enum):
    """The part of the engine that computes a quantity, and the loss-scale power it carries.

    ``order`` 1: from per-sample gradients in the backward pass; 2: from propagated
    curvature. A loss multiplied by ``s`` multiplies ``g_n`` and the curvature by ``s``, and
    squares of gradients by ``s²`` (``loss_scale_power``); for Kronecker factors the output
    side carries it, for ``[S, *bases]`` the eigenvalues ``S``.

    Attributes:
        PER_SAMPLE_GRADIENTS: the per-sample gradients ``g_n`` (order 1, power 1).
        SQUARED_NORMS: ``‖g_n‖²`` for each ``n`` (order 1, power 2).
        SUM_OF_SQUARES: ``Σ_n g_n²`` (order 1, power 2).
        MOMENTS: ``(Σ_n g_n², Σ_n g_n)`` (order 1, power 2).
        GGN_DIAGONAL: diagonals of propagated loss-Hessian square-root columns (order 2).
        HESSIAN_DIAGONAL: the GGN diagonal plus the residual terms of curved
            nonlinearities (order 2).
        KRONECKER: Kronecker factors of propagated columns (order 2).
        KFRA: the KFRA recursion (order 2).
        EIGEN_CORRECTED: ``Σ_n (Q_0ᵀ G_n Q_1)²`` in supplied or fresh bases (order 2).

    Example:
        >>> from curvopt import extensions as ext
        >>> p = ext.Producer.SQUARED_NORMS
        >>> p.order, p.loss_scale_power
        (1, 2)
    """

    PER_SAMPLE_GRADIENTS = ("the per-sample gradients g_n", 1, 1)
    SQUARED_NORMS = ("||g_n||^2 for each n", 1, 2)
    SUM_OF_SQUARES = ("sum_n g_n**2", 1, 2)
    MOMENTS = ("(sum_n g_n**2, sum_n g_n)", 1, 2)
    GGN_DIAGONAL = ("diagonals of propagated loss-Hessian square-root columns", 2, 1)
    HESSIAN_DIAGONAL = ("the GGN diagonal plus the residual terms of curved nonlinearities", 2, 1)
    KRONECKER = ("Kronecker factors of propagated columns (layers.kron)", 2, 1)
    KFRA = ("the KFRA recursion (kfra)", 2, 1)
    EIGEN_CORRECTED = (
        "sum_n (Q_0^T G_n Q_1)^2 from each call's inputs and output gradients (reducer), "
        "in supplied bases or those of this pass's Kronecker factors (curvature), times the "
        "loss's divisor over the factor the loss enters the backward with",
        2,
        1,
    )

    #: members are singletons compared by identity: the identity hash (a C slot) rather than
    #: ``Enum``'s ``hash(self._name_)``, a Python call in each of a pass's dict lookups
    __hash__ = object.__hash__

    @property
    def order(self) -> int:
        return self.value[1]

    @property
    def loss_scale_power(self) -> int:
        return self.value[2]


@dataclass(frozen=True)
class Quantity:
    """The declaration of ``p.<attr>``: what the value is and how passes combine.

    Every quantity ``collect`` writes is declared once, on its :class:`Extension` subclass
    (``quantity = Quantity(...)``); engine code asks the declaration, never the name.

    Args:
        attr: the attribute name, a Python identifier.
        kind: a :class:`Kind`.
        combine: a :class:`Combine`: how micro-batches combine (required, so that no
            quantity is silently summed).
        producer: a :class:`Producer`: which part of the engine computes it.
        reference: for first-order quantities, the value as a function of the per-sample
            gradients ``[N, *p.shape]`` (what ``verify`` checks against); ``None`` otherwise.

    Raises:
        TypeError: ``kind``, ``combine`` or ``producer`` is not a member of its enum.
        ValueError: ``attr`` is not an identifier.

    Example:
        >>> from curvopt import extensions as ext
        >>> q = ext.Quantity("my_sq", ext.Kind.SUMMED, ext.Combine.ADD, ext.Producer.SUM_OF_SQUARES)
        >>> q.per_sample, q.loss_scale_power
        (False, 2)
    """

    attr: str
    kind: Kind
    combine: Combine
    producer: Producer
    reference: Optional[Callable[[torch.Tensor], torch.Tensor]] = None

    def __post_init__(self):
        for field, cls in (("kind", Kind), ("combine", Combine), ("producer", Producer)):
            if not isinstance(getattr(self, field), cls):
                raise TypeError(
                    f"quantity {self.attr!r}: {field} must be a curvopt.extensions.{cls.__name__}, "
                    f"got {getattr(self, field)!r}"
                )
        if not self.attr.isidentifier():
            raise ValueError(f"quantity attribute must be an identifier, got {self.attr!r}")

    @property
    def per_sample(self) -> bool:
        return self.kind is Kind.PER_SAMPLE

    @property
    def loss_scale_power(self) -> int:
        """The power of a loss scale ``s`` its values carry (``values.unscaled``)."""
        return self.producer.loss_scale_power


_DECLARED: Dict[str, Quantity] = {}


def declare(q: Quantity) -> Quantity:
    """Register ``q`` so that :func:`quantity` finds it (``Extension`` subclasses call it).

    Args:
        q: the declaration.

    Returns:
        ``q``.

    Raises:
        ValueError: ``q.attr`` is already declared differently.

    Example:
        >>> from curvopt import extensions as ext
        >>> q = ext.declare(ext.quantity("kfac"))  # the same declaration again: accepted
        >>> q.attr
        'kfac'
    """
    old = _DECLARED.setdefault(q.attr, q)
    if old != q:
        raise ValueError(f"p.{q.attr} is declared twice, differently: {old} and {q}")
    return q


def quantity(attr: str) -> Quantity:
    """The declaration of ``p.<attr>``.

    Args:
        attr: the attribute name (``"grad_batch"``, ``"kfac"``, ...).

    Returns:
        Its :class:`Quantity`.

    Raises:
        KeyError: nothing declares ``p.<attr>``.

    Example:
        >>> from curvopt import extensions as ext
        >>> ext.quantity("variance").combine
        <Combine.MOMENTS: 'recomputed from the summed moments (sum g^2, sum g) and N_1 + N_2'>
    """
    try:
        return _DECLARED[attr]
    except KeyError:
        raise KeyError(
            f"curvopt: no quantity p.{attr} is declared; declare it with "
            "curvopt.extensions.Quantity on its Extension subclass"
        ) from None
