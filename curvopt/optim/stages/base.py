"""What a stage of the damped Newton step is, and the chain they form.

A step of one param group is planned as a :class:`GroupStep` holding one :class:`ParamStep`
per parameter that takes part. Stages run on it in increasing ``order``, each transforming
the update in the making, as optax's transforms do::

    g = ∇L + δθ                      10  weight_decay.AddWeightDecay       (not for δ = 0)
    C ← β C + (1 − β) C_new          20  curvature_ema.AverageCurvature    (not for β = 0)
    d = (C + (λ + δ) I)⁻¹ g          30  precondition.Precondition
    d ← ν d                          40  trust_region.ScaleByTrustRegion   (not for κ = None)
    v = μ v + d                      50  momentum.TraceMomentum            (not for μ = 0)
    v ← √max(1, m/n) polar(v)        57  orthogonalize.Orthogonalize       (not for False)
    Δ = lr · v                       60  learning_rate.ScaleByLearningRate
    Δ ← schedule-free Δ              70  schedule_free.ScheduleFree        (not for β = None)

A stage that is the identity under a group's options (its ``identity_at``, in parentheses
above) is not in that group's chain (:meth:`Chain.for_group`): a default KFAC step runs three.

State is explicit: a stage reads the parameter's state before the step from
``ParamStep.state`` (never modified) and writes what it keeps into ``update.state`` (the new
state, stored only when the whole plan is valid). Its hyper-parameters are the param group's
(``GroupStep.group``). The chain is a value, :class:`Chain`: each Newton optimizer class
declares its own (``stages``, :data:`curvopt.optim.stages.NEWTON` by default), and the
constructor argument ``stages=`` replaces it for one optimizer (``NEWTON.with_stage(...)``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch

from curvopt.optim.plan import ParamUpdate


@dataclass
class ParamStep:
    """One parameter's step in the making."""

    #: the planned change ``θ ← θ − update.delta``, its new state, checks and read quantities
    update: ParamUpdate
    #: ``g``: the (unscaled) gradient; the weight-decay stage adds ``δθ``
    grad: torch.Tensor
    #: the parameter's state before the step (read only)
    state: dict[str, Any]
    #: the curvature ``C`` in use (None: none, the fallback applies) and the step it is from:
    #: the one read at this step where one was (``fresh``), else the stored one
    curvature: Any = None
    curvature_step: int | None = None
    #: the curvature read at this step (None: none read), which the EMA stage averages with
    #: the stored one (``state["curvature"]``)
    fresh: Any = None
    #: the update being transformed: ``d``, then ``ν d``, then ``v`` (consumed by the lr stage,
    #: which may scale it in place into ``update.delta``)
    direction: torch.Tensor | None = None
    #: the tensor this step made and nothing else holds (not the gradient, the parameter, a
    #: tensor a state keeps): a stage may change it in place while it is still the one being
    #: transformed (``direction``; from the lr stage on ``update.delta``). A stage that keeps
    #: that tensor in a state sets ``own = None`` (as the momentum stage does)
    own: torch.Tensor | None = None
    #: under FSDP2 with the state kept by owners (``optim.distributed.fsdp.Rows``): the sharded
    #: parameter, its owner rank and this rank's shard. Up to the preconditioning stage the
    #: owner's item is whole and another rank's has no curvature; after it (``fsdp.exchange``)
    #: every rank's item holds its rows (gradient, direction, ``update.param``). None otherwise
    rows: Any = None

    def owns(self, tensor: torch.Tensor | None) -> bool:
        """Whether ``tensor`` is the step's own (:attr:`own`): a stage may change it in place."""
        return tensor is not None and tensor is self.own

    def scaled(self, factor: float) -> torch.Tensor:
        """``factor · direction``: in place where the step owns the direction (one pass, no
        new tensor of the parameter's size), else a new tensor, which the step then owns."""
        if self.owns(self.direction):
            return self.direction.mul_(factor)
        self.own = self.direction * factor
        return self.own

    def naming_errors(self) -> "NamingErrors":
        """A block in which a failed inversion (``torch.linalg.LinAlgError``) names the
        parameter (``update.description``) before what failed."""
        return NamingErrors(self.update.description)


def scaled_directions(items: list[ParamStep], factor: float) -> list[torch.Tensor]:
    """``factor · direction`` of each of ``items`` (:meth:`ParamStep.scaled`): the directions
    the step owns in place by one ``torch._foreach_mul_`` (element-wise: the bits of a
    ``mul_`` each, one call in place of one per parameter), the others into new tensors."""
    owns = [item.owns(item.direction) for item in items]
    owned = [item.direction for item, own in zip(items, owns) if own]
    if owned:
        torch._foreach_mul_(owned, factor)
    return [item.direction if own else item.scaled(factor) for item, own in zip(items, owns)]


class NamingErrors:
    """The block of :meth:`ParamStep.naming_errors`: a ``LinAlgError`` raised in it is raised
    again as one that starts with ``description`` (a class, not a generator: entered once per
    parameter at every step)."""

    __slots__ = ("description",)

    def __init__(self, description: str):
        self.description = description

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, traceback) -> bool:
        if kind is not None and issubclass(kind, torch.linalg.LinAlgError):
            raise torch.linalg.LinAlgError(f"{self.description}: {error}") from None
        return False


@dataclass(frozen=True)
class Preconditioner:
    """What the preconditioning stage asks of the optimizer, and no more: the damped directions
    ``d = (C + (λ + δ) I)⁻¹ g`` of the parameters with curvature (``directions``: one per
    item, in order; blocks of equal shapes may be applied together, ``optim.plan.Stacks``) and of
    one without (``fallback``), each with the cache entries its state keeps; the cached
    quantity a direction derives from a curvature (``derived(curvature, group, damping,
    curvature_step)``: an inverse or eigendecomposition, or None), which is computed ahead and
    spread over the ranks by ``distributed`` (a ``DistributedCurvature``; None: one process);
    and the metric the trust region measures a direction in (``measure``)."""

    directions: Callable[[list[ParamStep], "GroupStep"], list[tuple[torch.Tensor, dict[str, Any]]]]
    fallback: Callable[[ParamStep, "GroupStep"], tuple[torch.Tensor, dict[str, Any]]]
    derived: Callable[[Any, dict[str, Any], float, int], Any]
    distributed: Any = None
    #: the trust region's ``dᵀ M d`` of each of the items (all with curvature) in a metric
    #: ``M`` of the optimizer's (scalar tensors), or None for one: ``gᵀd``, the damped
    #: curvature's (None: always)
    measure: Callable[[list["ParamStep"], "GroupStep"], list[torch.Tensor | None]] | None = None


@dataclass
class GroupStep:
    """The step of one param group: its ``ParamStep``s and what every stage may read."""

    preconditioner: Preconditioner
    group: dict[str, Any]
    #: the group's step count and damping ``λ + δ`` (weight decay included)
    step: int
    damping: float
    params: list[ParamStep] = field(default_factory=list)
    #: the factor of the trust region's bound ``κ``: the loss's reduction scale ``s`` under a
    #: damping that follows it (``ReductionScaledDamping``), else 1
    kl_scale: float = 1.0


class Stage:
    """One transformation of the update; subclasses set ``order`` and implement ``__call__``."""

    #: where the stage runs in the chain (increasing)
    order: ClassVar[float]
    #: ``(option, value)``: the stage changes no number (bit for bit) in a param group whose
    #: ``option`` is ``value``, so that group's chain leaves it out (:meth:`Chain.for_group`)
    identity_at: ClassVar[tuple[str, Any] | None] = None

    def __call__(self, step: GroupStep) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(order={self.order})"


@dataclass(frozen=True)
class Chain:
    """The stages a Newton optimizer runs, in increasing ``order``: a value (as optax's
    ``chain``), declared by each optimizer class and replaceable per optimizer
    (``KFAC(..., stages=...)``)."""

    stages: tuple[Stage, ...]

    def __post_init__(self):
        orders = [s.order for s in self.stages]
        if orders != sorted(set(orders)):
            raise ValueError(
                f"the stages of a chain run in strictly increasing order, got {list(self.stages)}"
            )

    def __iter__(self):
        return iter(self.stages)

    def for_group(self, group: dict[str, Any]) -> tuple[Stage, ...]:
        """The stages that change the step of ``group``: all but those that are the identity
        under its options (``Stage.identity_at``: e.g. no momentum stage for ``momentum=0``)."""
        return tuple(
            s
            for s in self.stages
            if s.identity_at is None or group[s.identity_at[0]] != s.identity_at[1]
        )

    def with_stage(self, stage: Stage) -> "Chain":
        """This chain with ``stage`` inserted at its ``order`` (taken: ``ValueError``)."""
        clash = [s for s in self.stages if s.order == stage.order]
        if clash:
            raise ValueError(
                f"{type(stage).__name__}: {type(clash[0]).__name__} already runs at order "
                f"{stage.order}"
            )
        return Chain(tuple(sorted((*self.stages, stage), key=lambda s: s.order)))

    def without(self, kind: type[Stage]) -> "Chain":
        """This chain without its stages of type ``kind``."""
        return Chain(tuple(s for s in self.stages if not isinstance(s, kind)))
