"""What a stage of the damped Newton step is, and the chain they form.

A step of one param group is planned as a :class:`GroupStep` holding one :class:`ParamStep`
per parameter that takes part. Stages run on it in increasing ``order``, each transforming
the update in the making, as optax's transforms do::

    g = ∇L + δθ                      10  weight_decay.AddWeightDecay
    C ← β C + (1 − β) C_new          20  curvature_ema.AverageCurvature
    d = (C + (λ + δ) I)⁻¹ g          30  precondition.Precondition
    d ← ν d                          40  trust_region.ScaleByTrustRegion   (kl_clip)
    v = μ v + d                      50  momentum.TraceMomentum
    Δ = lr · v                       60  learning_rate.ScaleByLearningRate

State is explicit: a stage reads the parameter's state before the step from
``ParamStep.state`` (never modified) and writes what it keeps into ``update.state`` (the new
state, stored only when the whole plan is valid). Its hyper-parameters are the param group's
(``GroupStep.group``). Every module of :mod:`curvopt.optim.stages` is imported by the package,
and a stage class decorated with :func:`register` joins the chain of every Newton optimizer:
a new stage is one file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from curvopt.optim.base import ParamUpdate


@dataclass
class ParamStep:
    """One parameter's step in the making."""

    #: the planned change ``θ ← θ − update.delta``, its new state, checks and read quantities
    update: ParamUpdate
    #: ``g``: the (unscaled) gradient; the weight-decay stage adds ``δθ``
    grad: torch.Tensor
    #: the parameter's state before the step (read only)
    state: dict[str, Any]
    #: the curvature ``C`` in use (None: none, the fallback applies) and the step it is from
    curvature: Any = None
    curvature_step: int | None = None
    #: curvature read at this step, not yet averaged into ``curvature`` (None: none read)
    fresh: Any = None
    #: the update being transformed: ``d``, then ``ν d``, then ``v``
    direction: torch.Tensor | None = None


@dataclass
class GroupStep:
    """The step of one param group: its ``ParamStep``s and what every stage may read."""

    optimizer: Any  # the NewtonOptimizer (its hooks: _direction, _derived, _distributed, ...)
    group: dict[str, Any]
    #: the group's step count and damping ``λ + δ`` (weight decay included)
    step: int
    damping: float
    params: list[ParamStep] = field(default_factory=list)


class Stage:
    """One transformation of the update; subclasses set ``order`` and implement ``__call__``."""

    #: where the stage runs in the chain (increasing)
    order: ClassVar[float]

    def __call__(self, step: GroupStep) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(order={self.order})"


#: the registered stages, kept sorted by ``order``
_REGISTRY: list[Stage] = []


def register(cls: type[Stage]) -> type[Stage]:
    """Class decorator: an instance of ``cls`` joins the chain at ``cls.order``."""
    if any(type(s).order == cls.order for s in _REGISTRY):
        raise ValueError(f"{cls.__name__}: another stage already runs at order {cls.order}")
    _REGISTRY.append(cls())
    _REGISTRY.sort(key=lambda s: s.order)
    return cls


def chain() -> tuple[Stage, ...]:
    """The registered stages, in the order they run."""
    return tuple(_REGISTRY)
