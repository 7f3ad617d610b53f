"""Damping strategies: how the scalar ``λ`` added to the curvature evolves.

A strategy is a pure transform in the optax sense: its hyper-parameters live on the object,
its mutable state is a small dict created by :meth:`init` and replaced (never mutated) by
:meth:`update`, so optimizers can save and restore it with ``state_dict``.

* :class:`ConstantDamping` -- ``λ_t = λ``.
* :class:`ScheduledDamping` -- ``λ_t = f(t)`` for any callable ``f`` of the step count ``t``.
* :class:`LevenbergMarquardt` -- adapts ``λ`` from the reduction ratio ``ρ`` (Martens & Grosse
  2015, Sec. 6.5): ``λ ← ω λ`` if ``ρ < 1/4``, ``λ ← λ / ω`` if ``ρ > 3/4``.
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Callable, Union

import torch

State = dict[str, float]


def _check_nonnegative(name: str, value: float) -> None:
    if not isinstance(value, Real) or not value >= 0 or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


class ConstantDamping:
    """``λ_t = damping`` for every step ``t``."""

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
    """``λ_t = schedule(t)``: any callable of the step count ``t = 0, 1, ...``.

    The returned value is checked to be finite and ``>= 0`` at every step. To save the
    optimizer with ``torch.save``, use a picklable callable (a module-level function, not a lambda).
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
    ``interval`` steps: ``λ ← min(ω λ, max_damping)`` if ``ρ < 1/4`` (model too optimistic),
    ``λ ← max(λ / ω, min_damping)`` if ``ρ > 3/4`` (model trustworthy), else unchanged; an
    undefined ``ρ`` (NaN) leaves ``λ`` unchanged. ``omega`` defaults to ``(20/19)**interval``
    (Martens & Grosse use ``ω = (19/20)^{-T_1}``).
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


DampingStrategy = Union[ConstantDamping, ScheduledDamping, LevenbergMarquardt]


def as_damping(damping) -> DampingStrategy:
    """A strategy from a number (constant), a callable of the step (schedule) or a strategy.

    Raises ``ValueError`` for anything else, and for negative or non-finite numbers.
    """
    if isinstance(damping, (ConstantDamping, ScheduledDamping, LevenbergMarquardt)):
        return damping
    if isinstance(damping, Real) and not isinstance(damping, bool):
        return ConstantDamping(damping)
    if callable(damping):
        return ScheduledDamping(damping)
    raise ValueError(
        f"damping must be a number >= 0, a callable of the step count or a damping strategy "
        f"(ConstantDamping, ScheduledDamping, LevenbergMarquardt), got {damping!r}"
    )


def reduction_ratio(actual: float, predicted: float) -> float:
    """``ρ = actual / predicted``: actual over predicted change of the loss.

    Both are changes ``f(θ + s) − f(θ)``; a good step has both negative and ``ρ ≈ 1``.
    Returns NaN (undefined: leave the damping alone) when the model predicts no decrease
    (``predicted >= 0`` or not finite), and ``-inf`` (a failed step) when the actual change is
    not finite.
    """
    if not math.isfinite(predicted) or predicted >= 0:
        return math.nan
    if not math.isfinite(actual):
        return -math.inf
    return actual / predicted


# plain-data strategies may be loaded with torch.load(weights_only=True) (a schedule holds code)
torch.serialization.add_safe_globals([ConstantDamping, LevenbergMarquardt])
