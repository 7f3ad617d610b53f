"""Damping strategies: how the scalar ``λ`` added to the curvature evolves.

A strategy is a pure transform in the optax sense: its hyper-parameters live on the object,
its mutable state is a small dict created by :meth:`init` and replaced (never mutated) by
:meth:`update`, so optimizers can save and restore it with ``state_dict``.

* :class:`ConstantDamping` -- ``λ_t = λ``.
* :class:`ScheduledDamping` -- ``λ_t = f(t)`` for any callable ``f`` of the step count ``t``.
* :class:`LevenbergMarquardt` -- adapts ``λ`` from the reduction ratio ``ρ`` (Martens & Grosse
  2015, Sec. 6.5): ``λ ← ω λ`` if ``ρ < 1/4``, ``λ ← λ / ω`` if ``ρ > 3/4``.
* :class:`RelativeDamping` -- ``λ = α · m``, a fraction of the curvature's mean eigenvalue
  ``m = tr(C)/dim(C)`` over a param group (``relative_damping=α``).
* :class:`ReductionScaledDamping` -- ``λ = α · s``, ``s`` the factor by which the loss's
  reduction scales one sample's curvature (the Newton optimizers' default, ``damping=None``).
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Callable, Union

import torch

State = dict[str, float]


def _check_nonnegative(name: str, value: float) -> None:
    if not isinstance(value, Real) or not value >= 0 or not math.isfinite(value):
        raise ValueError(
            f"{name} must be a finite number (float or int) >= 0, got {value!r} of type "
            f"{type(value).__name__}"
        )


class ConstantDamping:
    """The constant damping ``λ_t = damping`` for every step ``t``.

    What a number passed as ``damping=`` to an optimizer becomes (:func:`as_damping`).

    Args:
        damping: ``λ ≥ 0``, finite.

    Raises:
        ValueError: ``damping`` is negative or not finite.

    Example:
        >>> from curvopt.optim import ConstantDamping
        >>> strategy = ConstantDamping(1e-3)
        >>> strategy.value(strategy.init(), step=10)
        0.001
    """

    adaptive = False

    def __init__(self, damping: float):
        _check_nonnegative("damping", damping)
        self.damping = float(damping)

    def init(self) -> State:
        return {}

    def value(self, state: State, step: int) -> float:
        return self.damping

    def update(self, state: State, rho: float) -> State:
        return state

    def __repr__(self) -> str:
        return f"ConstantDamping({self.damping!r})"


class ScheduledDamping:
    """A damping schedule ``λ_t = schedule(t)`` of the step count ``t = 0, 1, ...``.

    What a callable passed as ``damping=`` to an optimizer becomes (:func:`as_damping`). The
    returned value is checked to be finite and ``>= 0`` at every step. To save the optimizer
    with ``torch.save``, use a picklable callable (a module-level function, not a lambda).

    Args:
        schedule: a callable ``int -> float``.

    Raises:
        TypeError: ``schedule`` is not callable.
        ValueError: (at a step) ``schedule(t)`` is negative or not finite.

    Example:
        >>> from curvopt.optim import ScheduledDamping
        >>> strategy = ScheduledDamping(lambda t: 1.0 / (t + 1))
        >>> strategy.value(strategy.init(), step=3)
        0.25
    """

    adaptive = False

    def __init__(self, schedule: Callable[[int], float]):
        if not callable(schedule):
            raise TypeError(f"schedule must be callable, got {schedule!r}")
        self.schedule = schedule

    def init(self) -> State:
        return {}

    def value(self, state: State, step: int) -> float:
        damping = self.schedule(step)
        _check_nonnegative(f"damping schedule({step})", damping)
        return float(damping)

    def update(self, state: State, rho: float) -> State:
        return state

    def __repr__(self) -> str:
        return f"ScheduledDamping({self.schedule!r})"


class LevenbergMarquardt:
    """Levenberg–Marquardt adaptive damping driven by the reduction ratio ``ρ``.

    ``ρ = (L(θ + s) − L(θ)) / (q(s) − q(0))`` compares the actual change of the loss with the
    change predicted by the quadratic model ``q`` (see :func:`reduction_ratio`). Every
    ``interval`` steps (Martens & Grosse 2015, Sec. 6.5): ``λ ← min(ω λ, max_damping)`` if
    ``ρ < 1/4`` (model too optimistic), ``λ ← max(λ / ω, min_damping)`` if ``ρ > 3/4`` (model
    trustworthy), else unchanged; an undefined ``ρ`` (NaN) leaves ``λ`` unchanged. The
    optimizer measures ``ρ`` from the loss of a closure, so ``opt.step(closure)`` is needed.

    Args:
        damping: the initial ``λ``, with ``min_damping <= damping <= max_damping``.
        omega: the factor ``ω > 1``; default ``(20/19)**interval`` (Martens & Grosse use
            ``ω = (19/20)^{-T_1}``).
        interval: measure ``ρ`` and adapt every ``interval ≥ 1`` steps (default 5).
        min_damping: lower bound of ``λ`` (default ``1e-8``).
        max_damping: upper bound of ``λ`` (default ``1e8``).

    Raises:
        ValueError: a negative or non-finite bound or damping, ``interval < 1``,
            ``omega <= 1``, or ``damping`` outside ``[min_damping, max_damping]``.

    Example:
        >>> from curvopt.optim import LevenbergMarquardt
        >>> strategy = LevenbergMarquardt(1.0, omega=2.0, interval=1)
        >>> state = strategy.update(strategy.init(), rho=0.1)  # the model was too optimistic
        >>> strategy.value(state, step=1)
        2.0
        >>> strategy.value(strategy.update(state, rho=0.9), step=2)
        1.0
    """

    adaptive = True

    def __init__(
        self,
        damping: float,
        omega: float | None = None,
        interval: int = 5,
        min_damping: float = 1e-8,
        max_damping: float = 1e8,
    ):
        _check_nonnegative("damping", damping)
        _check_nonnegative("min_damping", min_damping)
        _check_nonnegative("max_damping", max_damping)
        if not isinstance(interval, int) or interval < 1:
            raise ValueError(f"interval must be an int >= 1, got {interval!r}")
        omega = (20 / 19) ** interval if omega is None else omega
        if not isinstance(omega, Real) or not omega > 1 or not math.isfinite(omega):
            raise ValueError(f"omega must be a finite number > 1, got {omega!r}")
        if not min_damping <= damping <= max_damping:
            raise ValueError(
                f"need min_damping <= damping <= max_damping, got {min_damping} <= {damping} "
                f"<= {max_damping}"
            )
        self.damping = float(damping)
        self.omega = float(omega)
        self.interval = interval
        self.min_damping = float(min_damping)
        self.max_damping = float(max_damping)

    def init(self) -> State:
        return {"damping": self.damping}

    def value(self, state: State, step: int) -> float:
        return state["damping"]

    def due(self, step: int) -> bool:
        """Whether ``ρ`` is measured after step ``step`` (``step % interval == 0``)."""
        return step % self.interval == 0

    def update(self, state: State, rho: float) -> State:
        damping = state["damping"]
        if rho < 0.25:
            damping = min(damping * self.omega, self.max_damping)
        elif rho > 0.75:
            damping = max(damping / self.omega, self.min_damping)
        return {"damping": damping}

    def __repr__(self) -> str:
        return (
            f"LevenbergMarquardt({self.damping!r}, omega={self.omega!r}, interval={self.interval}"
            f", min_damping={self.min_damping!r}, max_damping={self.max_damping!r})"
        )


class RelativeDamping:
    """A damping that follows the curvature's scale: ``λ = α · m``, ``m`` the mean over a param
    group's parameters of their curvature's mean eigenvalue ``tr(C)/dim(C)`` (``B ⊗ A``:
    ``(tr B/dim B)(tr A/dim A)``; a diagonal: its mean; eigen-corrected: the mean of ``S``)
    at the first refresh, kept from then on: the scale of the loss, not of a curvature that
    collapses once the model fits its batches (the Gauss-Newton matrix of a confident
    classifier goes to zero, and a damping that followed it would let the steps grow without
    bound).

    What ``damping=None`` of ``DiagGGNNewton``, ``KFAC`` and ``EKFAC`` becomes with a number
    ``α = relative_damping``. Multiplying the loss by ``c`` multiplies ``C`` and ``λ`` by
    ``c``, so the step ``(C + λ I)⁻¹ g`` is the same: one default serves a loss summed over
    samples, a per-sample mean and a mean over pixels. One ``λ`` for the group, not one per
    parameter: a layer whose curvature is (nearly) zero or of low rank at a refresh (few
    samples, a wide layer) is damped on the scale of the others, not by a fraction of its own
    vanishing scale. A curvature without scale (all zero) gets ``min_damping``. The value the
    optimizer reports (:meth:`value`) is ``α``.

    Args:
        fraction: ``α ≥ 0``, finite.
        min_damping: the least ``λ`` (default ``1e-8``).

    Raises:
        ValueError: ``fraction`` or ``min_damping`` is negative or not finite.

    Example:
        >>> from curvopt.optim import RelativeDamping
        >>> RelativeDamping(0.1).of(scale=40.0)  # λ for curvatures of mean eigenvalue 40
        4.0
    """

    adaptive = False

    def __init__(self, fraction: float, min_damping: float = 1e-8):
        _check_nonnegative("relative_damping", fraction)
        _check_nonnegative("min_damping", min_damping)
        self.fraction = float(fraction)
        self.min_damping = float(min_damping)

    def init(self) -> State:
        return {}

    def value(self, state: State, step: int) -> float:
        return self.fraction

    def update(self, state: State, rho: float) -> State:
        return state

    def of(self, scale: float) -> float:
        """``λ = max(α · scale, min_damping)`` for a curvature whose mean eigenvalue is
        ``scale``."""
        return max(self.fraction * scale, self.min_damping)

    def __repr__(self) -> str:
        return f"RelativeDamping({self.fraction!r}, min_damping={self.min_damping!r})"


class ReductionScaledDamping:
    """A damping that follows the loss's reduction: ``λ = α · s``, ``s = Σ w N / D`` the factor
    by which the reduction of the loss scales one sample's curvature (``N`` the loss's samples,
    ``D`` its divisor, ``w`` the factor it enters the backward with, summed over the losses and
    the micro-batches of a step: ``losses.base.LossRule.reduction_scale``), re-read at every
    refresh of the curvature. ``s = 1`` for a mean over samples, ``N`` for a sum (``s``
    follows the batch), ``1/P`` for a mean over ``P`` outputs per sample (a per-pixel mean).

    What ``damping=None`` (the default) of ``DiagGGNNewton``, ``KFAC`` and ``EKFAC`` becomes.
    Multiplying the loss by ``c`` multiplies ``C``, ``g``, ``s`` and so ``λ`` by ``c``: the
    direction ``(C + λ I)⁻¹ g`` is the same, and the trust region ``kl_clip`` follows ``s`` too
    (the optimizers bound ``lr² gᵀd`` by ``κ s``), so the step is the same: one ``α`` serves a
    sum over samples, a per-sample mean and a mean over pixels. Unlike a fraction of the
    curvature's own scale (:class:`RelativeDamping`), ``s`` does not depend on the network:
    the damping that trains the DeepOBS networks, the timm and ViT swaps and a badly scaled
    GPT is about ``3e-3`` to ``1e-2`` per sample, whereas their curvatures' mean eigenvalues
    spread over three decades (``docs/optim.md``). The value the optimizer reports
    (:meth:`value`) is ``α``.

    Args:
        fraction: ``α ≥ 0``, finite: the damping of a loss averaged over samples.

    Raises:
        ValueError: ``fraction`` is negative or not finite.

    Example:
        >>> from curvopt.optim import ReductionScaledDamping
        >>> ReductionScaledDamping(1e-2).of(scale=128.0)  # a loss summed over 128 samples
        1.28
    """

    adaptive = False

    def __init__(self, fraction: float):
        _check_nonnegative("ReductionScaledDamping fraction", fraction)
        self.fraction = float(fraction)

    def init(self) -> State:
        return {}

    def value(self, state: State, step: int) -> float:
        return self.fraction

    def update(self, state: State, rho: float) -> State:
        return state

    def of(self, scale: float) -> float:
        """``λ = α · scale`` for a loss whose reduction scales a sample's curvature by
        ``scale``."""
        return self.fraction * scale

    def __repr__(self) -> str:
        return f"ReductionScaledDamping({self.fraction!r})"


DampingStrategy = Union[
    ConstantDamping, ScheduledDamping, LevenbergMarquardt, RelativeDamping, ReductionScaledDamping
]


def as_damping(damping) -> DampingStrategy:
    """The damping strategy of an optimizer's ``damping=`` argument.

    Args:
        damping: a number (``≥ 0``: :class:`ConstantDamping`), a callable of the step count
            (:class:`ScheduledDamping`) or a strategy (returned as it is).

    Returns:
        A :class:`ConstantDamping`, :class:`ScheduledDamping`, or the strategy given.

    Raises:
        ValueError: anything else, or a negative or non-finite number.

    Example:
        >>> from curvopt.optim import as_damping
        >>> as_damping(1e-3)
        ConstantDamping(0.001)
    """
    if isinstance(damping, DampingStrategy.__args__):
        return damping
    if isinstance(damping, Real) and not isinstance(damping, bool):
        return ConstantDamping(damping)
    if callable(damping):
        return ScheduledDamping(damping)
    raise ValueError(
        f"damping must be a number >= 0, a callable of the step count or a damping strategy "
        "(ConstantDamping, ScheduledDamping, LevenbergMarquardt, RelativeDamping, "
        f"ReductionScaledDamping), got {damping!r} of type {type(damping).__name__}"
    )


def damping_strategy(
    damping, relative_damping: float | None, reduction_damping: float
) -> DampingStrategy:
    """The strategy of a param group's ``damping``: for ``None`` (the Newton optimizers'
    default) :class:`RelativeDamping` of ``relative_damping`` where it is a number, else
    :class:`ReductionScaledDamping` of ``reduction_damping``; otherwise :func:`as_damping`."""
    if damping is not None:
        return as_damping(damping)
    if relative_damping is not None:
        return RelativeDamping(relative_damping)
    return ReductionScaledDamping(reduction_damping)


def reduction_ratio(actual: float, predicted: float) -> float:
    """The reduction ratio ``ρ = actual / predicted`` of the loss's actual and predicted change.

    Both are changes ``f(θ + s) − f(θ)``; a good step has both negative and ``ρ ≈ 1``.

    Args:
        actual: the change of the loss the step made.
        predicted: the change the quadratic model predicted.

    Returns:
        ``ρ``; NaN (undefined: leave the damping alone) when the model predicts no decrease
        (``predicted >= 0`` or not finite), and ``-inf`` (a failed step) when the actual change
        is not finite.

    Example:
        >>> from curvopt.optim import reduction_ratio
        >>> reduction_ratio(-0.5, -1.0)
        0.5
        >>> reduction_ratio(-0.5, 0.0)
        nan
    """
    if not math.isfinite(predicted) or predicted >= 0:
        return math.nan
    if not math.isfinite(actual):
        return -math.inf
    return actual / predicted


# plain-data strategies may be loaded with torch.load(weights_only=True) (a schedule holds code)
torch.serialization.add_safe_globals(
    [ConstantDamping, LevenbergMarquardt, RelativeDamping, ReductionScaledDamping]
)
