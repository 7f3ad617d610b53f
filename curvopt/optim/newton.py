"""Damped Newton steps with a curvature ``C`` read from each parameter.

Per parameter, with damping ``λ`` and weight decay ``δ`` (BackPACK paper, Dangel et al. 2020)::

    g = ∇L + δ θ
    d = (C + (λ + δ) I)⁻¹ g                      (subclass: diagonal or Kronecker)
    ν = min(1, sqrt(κ / (lr² Σ gᵀd)))            (trust region over the group; κ = kl_clip)
    v = μ v + ν d                                (momentum μ, default 0)
    θ ← θ − lr · v

Each line is one stage of :mod:`curvopt.optim.stages` (weight decay, curvature EMA,
preconditioning, trust region, momentum, learning rate), run in that order on every param
group, less those that are the identity under the group's options (``Chain.for_group``: no
weight decay, EMA, trust region or momentum stage where they are off); this module plans
around them (which parameters take part, the curvature read where due, in use at once, the
quadratic model of adaptive damping).

The trust region is on by default (``kl_clip=1e-3``, kfac-pytorch's default): ``lr² gᵀd``
is the step's squared length in the damped curvature, ``sᵀ(C + λ'I)s`` (twice the curvature term of
the damped quadratic model of the loss) and, for a Fisher-type ``C``, a proxy for twice the
KL divergence between the model's predictions before and after the step (for
``reduction="mean"``: per sample). With a damping far below the curvature's scale (or sampled
factors whose range misses part of the gradient), the paper's step ``lr · d`` is many times
longer than the model can be trusted, and training diverges; ``ν`` shortens exactly those
steps, so the effective step is ``min(lr, sqrt(κ / gᵀd)) · d``. ``kl_clip=None`` gives the
paper's update ``θ ← θ − lr · d`` (Dangel et al. 2020). For ``reduction="sum"`` ``gᵀd``
grows with the batch size ``N``: under the default damping the bound is ``κ s`` (``s = N``),
with a damping given scale ``κ`` by ``N`` to keep the same per-sample bound.

A step whose gradient, curvature, update or resulting parameters are not finite raises
``FloatingPointError`` naming the optimizer, the parameter and the options to change; a
closure's loss over ``LOSS_GROWTH`` (1000) times the first one warns. A finite loss that
grows without a closure is not seen by the optimizer.

By default (``damping=None``) the damping follows the loss's scale: ``λ = α s``, ``s`` the factor
by which the loss's reduction scales one sample's curvature, handed over by the pass and re-read
at every refresh (:class:`~curvopt.inversion.damping.ReductionScaledDamping`; the trust region's
bound is then ``κ s``); ``relative_damping=α`` damps by a fraction of the curvatures' mean
eigenvalue at the first refresh instead (:class:`~curvopt.inversion.damping.RelativeDamping`).
``C`` is read every 10 steps (``curvature_interval=None``; 1 with a damping given), the steps
between plain ones that leave the engine alone (``frontend.collection``).

Opt-in, per param group: ``curvature_interval`` (read ``C`` every k steps, reuse it between),
``curvature_ema`` (``C ← β C + (1 − β) C_new``), ``momentum``, ``schedule_free`` (β; evaluate
after ``opt.eval()``), adaptive damping (:class:`~curvopt.inversion.damping.LevenbergMarquardt`)
and ``fallback='sgd'``; for the Kronecker optimizers ``fallback='diagonal'`` is the default
(:mod:`curvopt.optim.fallback`: parameters without Kronecker factors, announced once).

Under ``torch.distributed`` (see :mod:`curvopt.optim.distributed`) the curvature is averaged over
the ranks when it is read, and the derived quantities that are due (:meth:`_derived`: inverses,
eigendecompositions) are computed before the directions, each on one rank, and broadcast.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from itertools import repeat
from typing import Any, Callable, ClassVar

import torch

from curvopt import extensions

from curvopt.core import values
from curvopt.core.extended import path_of
from curvopt.optim.base import CurvatureOptimizer, ExtensionSpec, number, skip_options
from curvopt.inversion.damping import (
    ReductionScaledDamping,
    RelativeDamping,
    damping_strategy,
    reduction_ratio,
)
from curvopt.optim.distributed.fsdp import FullView
from curvopt.optim.fallback import announce
from curvopt.optim.options import DEFAULT_REDUCTION_DAMPING
from curvopt.optim.plan import ParamUpdate, Stacks, batches_pay, refresh_interval
from curvopt.optim.stages import (
    NEWTON,
    Chain,
    GroupStep,
    ParamStep,
    Preconditioner,
    schedule_free,
)


@dataclass
class Derived:
    """An expensive quantity derived from a parameter's curvature, cached in its state.

    ``cached(state.get(name), key, step, interval, compute)`` gives the entry to use;
    ``empty()`` returns uninitialised tensors of ``compute()``'s structure (to receive it).
    """

    name: str
    key: Any
    interval: int
    compute: Callable[[], Any]
    empty: Callable[[], Any]


class NewtonOptimizer(CurvatureOptimizer):
    """Shared step of :class:`DiagGGNNewton`, :class:`KFAC` and :class:`EKFAC`.

    Subclasses declare ``Options`` (a :class:`~curvopt.optim.options.NewtonOptions` subclass:
    their constructor is written from it), define :meth:`_extension` (which curvature to
    collect), :meth:`_direction` (``(C + λ I)⁻¹ g``) and :meth:`_quadratic` (``sᵀ C s``), and
    may check the curvature's shape in :meth:`_check_curvature` and declare a cached inverse
    in :meth:`_derived`.

    Per parameter the step is ``θ ← θ − lr · v`` with ``g = ∇L + δ θ``,
    ``d = (C + (λ + δ) I)⁻¹ g``, the trust-region factor ``ν`` (``kl_clip``) and
    ``v = μ v + ν d`` (see the module docstring).

    Args:
        params: parameters or param groups, as for ``torch.optim.SGD``.
        defaults: the hyper-parameters of every param group (from ``Options``).
        process_group: under ``torch.distributed``: ``None``, a ``ProcessGroup``, a
            ``DistributedCurvature`` or ``False``, as for :class:`CurvatureOptimizer`.
        collection: ``"auto"`` (default) or ``"explicit"``, as for
            :class:`CurvatureOptimizer`.
        stages: ``None`` (default: the class's chain, ``curvopt.optim.stages.NEWTON``) or a
            ``curvopt.optim.stages.Chain`` that replaces it.

    Raises:
        TypeError: ``stages`` is not a ``Chain``.

    Example:
        >>> import torch, curvopt
        >>> model = curvopt.extend(torch.nn.Sequential(torch.nn.Linear(3, 2)))
        >>> opt = curvopt.optim.KFAC(model.parameters(), lr=0.1, damping=1e-3)
        >>> isinstance(opt, curvopt.optim.NewtonOptimizer)
        True
        >>> opt.damping()  # the damping the next step of param group 0 uses
        0.001
    """

    _distributable = True
    #: under FSDP2, keep each layer's state on its owner rank only (:meth:`_sharded_layout`)
    _owned_state = True
    #: the chain of stages this class runs (a constructor argument ``stages=`` replaces it)
    stages: ClassVar[Chain] = NEWTON
    _KEYWORDS: ClassVar[dict[str, Any]] = {**CurvatureOptimizer._KEYWORDS, "stages": None}

    def __init__(self, params, defaults, process_group=None, collection="auto", stages=None):
        if stages is not None and not isinstance(stages, Chain):
            raise TypeError(
                f"{type(self).__name__}: stages must be a curvopt.optim.stages.Chain (e.g. "
                f"curvopt.optim.stages.NEWTON.with_stage(...)), got {type(stages).__name__}"
            )
        self._stages = type(self).stages if stages is None else stages
        super().__init__(params, defaults, process_group, collection)

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_stages": self._stages}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_stages", type(self).stages)

    _remedy = (
        "Lower the learning rate (lr), increase the damping, or keep the trust region on "
        "(kl_clip, default 1e-3; kl_clip=None turns it off)"
    )
    #: a closure's loss above this multiple of the run's first one warns (the steps diverge)
    LOSS_GROWTH = 1e3

    def step(self, closure=None):
        """As :meth:`CurvatureOptimizer.step`; with a closure, warns (``RuntimeWarning``) when
        its loss exceeds ``LOSS_GROWTH`` times the first closure loss of this optimizer."""
        if any(group_state.get("averaged") for group_state in self._group_state):
            raise RuntimeError(
                f"{type(self).__name__}: step() after opt.eval(), while the parameters hold the "
                "schedule-free average; call opt.train() first"
            )
        self._fell_back: dict[str, str] = {}  # name -> fallback, of the step being planned
        loss = super().step(closure)
        if self._fell_back:
            announced = self.__dict__.setdefault("_announced", set())
            announce(type(self).__name__, self._fell_back, announced)
        if loss is not None:
            value = number(loss)
            first = self.__dict__.setdefault("_first_loss", value)
            if first > 0 and value > self.LOSS_GROWTH * first:
                clips = sorted({str(group["kl_clip"]) for group in self.param_groups})
                warnings.warn(
                    f"{type(self).__name__}: the closure's loss {value:.4g} is over "
                    f"{self.LOSS_GROWTH:g}x the first one ({first:.4g}): the steps are diverging "
                    f"(kl_clip={', '.join(clips)}). {self._remedy}.",
                    RuntimeWarning,
                    stacklevel=2,
                )
        return loss

    # ----------------------------------------------------------------- schedule-free
    def eval(self) -> None:
        """Put the average ``x`` into the parameters of the groups with ``schedule_free``
        (:mod:`~curvopt.optim.stages.schedule_free`), to evaluate; the others stay. Which
        groups hold ``x`` is group state (``"averaged"``), saved with ``state_dict``."""
        self._swap(True, schedule_free.average)

    def train(self) -> None:
        """Put the training point ``y`` back into the parameters after :meth:`eval`."""
        self._swap(False, schedule_free.gradient_point)

    def _swap(self, averaged: bool, to: Callable) -> None:
        for group, group_state in zip(self.param_groups, self._group_state):
            beta, now = group["schedule_free"], group_state.get("averaged", False)
            if beta is not None and now != averaged:
                schedule_free.swap(group, self.state, to)
                group_state["averaged"] = averaged

    # ----------------------------------------------------------------- subclass hooks
    def _extension(self, group: dict[str, Any]) -> ExtensionSpec:
        """The extension giving the curvature of ``group``: ``(the attribute it writes,
        options)``."""
        raise NotImplementedError

    def _collect_options(self) -> dict[str, Any]:
        """The collection skips the parameters without Kronecker factors where a group has a
        ``fallback``, writing their diagonal where the group's extension declares one
        (``writer.fallback``; KFRA's does not) and the group asks for ``"diagonal"``."""
        diagonal = any(
            getattr(extensions.writer(self._extension(g)[0]), "fallback", None) is not None
            for g in self.param_groups
        )
        return skip_options(self.param_groups, diagonal)

    def _check_curvature(self, curvature: Any, param: torch.Tensor) -> None:
        """Raise ``ValueError`` if ``curvature`` does not fit ``param``."""

    def _direction(self, item: ParamStep, step: GroupStep) -> tuple[torch.Tensor, dict[str, Any]]:
        """``(C + λ I)⁻¹ g`` for one parameter (``item``: its ``grad``, ``curvature``,
        ``curvature_step``, ``state``; ``step``: the group's ``group``, ``step`` and
        ``damping``), shaped like ``g``, and the cache entries to keep in its state."""
        raise NotImplementedError

    def _directions(
        self, items: list[ParamStep], step: GroupStep
    ) -> list[tuple[torch.Tensor, dict[str, Any]]]:
        """:meth:`_direction` of each of ``items`` (all with curvature), in order; a subclass
        may apply blocks of equal shapes together (``optim.plan.Stacks``, :meth:`_stacks`)."""
        out = []
        for item in items:
            with item.naming_errors():
                out.append(self._direction(item, step))
        return out

    def _batches(self, device: torch.device) -> bool:
        """Whether this optimizer applies the blocks on ``device`` in batches
        (``plan.batches_pay``: not on a CPU)."""
        return batches_pay(device)

    def _batching(self, items: list[ParamStep]) -> bool:
        """Whether any of ``items`` is on a device whose blocks are applied in batches
        (:meth:`_batches`; else, on a CPU, the buckets are not formed at all)."""
        return any(self._batches(device) for device in {item.grad.device for item in items})

    def _stacks(self) -> Stacks:
        """The stacked operands this optimizer's batched products keep (a cache, not saved)."""
        return self.__dict__.setdefault("_stacked", Stacks())

    def _quadratic(self, curvature: Any, step: torch.Tensor) -> torch.Tensor:
        """``sᵀ C s`` for a step ``s`` of the parameter's shape."""
        raise NotImplementedError

    def _fallback_direction(
        self, item: ParamStep, step: GroupStep
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """The direction (and new state) of a parameter without curvature: ``item.grad``
        itself (``fallback='sgd'``)."""
        return item.grad, {}

    def _fallback_available(self, update: ParamUpdate, group: dict[str, Any]) -> bool:
        """Whether the group's ``fallback`` can step ``update``'s parameter, which has no
        curvature after the pass (default: yes); where not, reading it raises, naming it."""
        return True

    def _derived(
        self, curvature: Any, group: dict[str, Any], damping: float, curvature_step: int
    ) -> Derived | None:
        """The cached quantity :meth:`_direction` derives from ``curvature`` (None: none).

        Computed lazily by ``_direction`` in one process; under ``torch.distributed`` computed
        ahead, each on one rank, and handed to ``_direction`` in its ``state``.
        """
        return None

    # ----------------------------------------------------------------- planning
    def _curvature_due(self, group: dict[str, Any], group_state: dict[str, Any]) -> bool:
        interval = refresh_interval(group["curvature_interval"], group["damping"])
        return group_state["step"] % interval == 0

    def _needs(self, group, group_state) -> list[ExtensionSpec]:
        if self._curvature_due(group, group_state):
            return [self._extension(group)]
        params = [p for p in group["params"] if p.requires_grad]
        states = [s for s in map(self.state.get, params, repeat({})) if "curvature" not in s]
        if any([self._lacks_curvature(group, state) for state in states]):
            return [self._extension(group)]
        return []

    def _lacks_curvature(self, group, state) -> bool:
        """Whether a parameter whose state is ``state`` has no stored curvature and no fallback
        that steps it without one (``"sgd"``, or a ``"diagonal"`` already kept): it must be
        read at the next step, due or not. Asked only of a state without ``"curvature"`` (one
        with a stored curvature lacks none)."""
        fallback = group["fallback"]
        if "curvature" in state or "curvature_owner" in state or fallback == "sgd":
            return False
        return fallback is None or "fallback_diagonal" not in state

    def _damping(self, group, group_state):
        strategy = damping_strategy(
            group["damping"], group["relative_damping"], DEFAULT_REDUCTION_DAMPING
        )
        return strategy, group_state["damping"] or strategy.init()

    def _plan_group(self, group, group_state, with_model):
        """The group's :class:`~curvopt.optim.stages.GroupStep` (curvature read where due)
        through the chain of stages, and the decrease the quadratic model predicts."""
        damping = self._total_damping(group, group_state)
        step = GroupStep(self._preconditioner(), group, group_state["step"], damping)
        attr, _ = self._extension(group)
        extension = extensions.writer(attr).__name__
        due = self._curvature_due(group, group_state)
        params = group["params"]
        unused = self._unused(params, (attr,))
        sharded = isinstance(self._view, FullView)
        for param, key, description in zip(params, map(id, params), self._descriptions(group)):
            if key in unused:
                continue
            state = self.state.get(param, {})
            update = ParamUpdate(param, description, checks=[("gradient", param.grad)])
            curvature = state.get("curvature"), state.get("curvature_step")
            item = ParamStep(update, self._grad(param), state, *curvature)
            if sharded:  # FSDP2, owned state: its owner and rows
                item.rows = self._view.rows(param)
            if due or ("curvature" not in state and self._lacks_curvature(group, state)):
                item.fresh = self._read_curvature(update, group, attr, extension)
                if self._view.remote(param):  # checked here, kept by its owner
                    item.fresh = None
                elif item.fresh is not None:  # in use from this step on (the EMA stage averages)
                    item.curvature, item.curvature_step = item.fresh, step.step
                elif item.curvature is None:  # stepped by the fallback: announced once
                    name = path_of(param) or update.description
                    self.__dict__.setdefault("_fell_back", {})[name] = group["fallback"]
            step.params.append(item)
        strategy, _ = self._damping(group, group_state)
        if isinstance(strategy, RelativeDamping):
            step.damping = self._relative_damping(step, group_state)
        elif isinstance(strategy, ReductionScaledDamping):
            step.kl_scale = self._group_reduction_scale(step, group_state)
            step.damping = strategy.of(step.kl_scale) + group["weight_decay"]
        for stage in self._stages.for_group(group):
            stage(step)
        predicted = self._predicted(step) if with_model else 0.0
        return [item.update for item in step.params], predicted

    def _preconditioner(self) -> Preconditioner:
        """The stages' narrow view of this optimizer (``stages.base.Preconditioner``)."""
        return Preconditioner(
            self._directions, self._fallback_direction, self._derived, self._distributed
        )

    # ----------------------------------------------------------------- scale-following damping
    def _relative_damping(self, step: GroupStep, group_state: dict[str, Any]) -> float:
        """``λ + δ`` of a group with relative damping (``relative_damping=α``): ``λ = α · m``, ``m``
        the mean over the group's parameters of their curvature's mean eigenvalue
        (:meth:`_curvature_scale`) at the first refresh that finds one above zero (one host
        read), kept in the group state from then on: the scale of the loss, not of a
        curvature that collapses once the batches are fit."""
        scale = group_state.get("curvature_scale")
        curvatures = [item.curvature for item in step.params if item.curvature is not None]
        sharded = any([item.rows is not None for item in step.params])
        if scale is None and sharded:  # FSDP2, owned state: each rank its layers' part
            found = self._scale_over_ranks(step)
            if found > 0:
                scale = group_state["curvature_scale"] = found
        elif scale is None and curvatures:
            device = _device(curvatures[0])
            scales = [self._curvature_scale(c).to(device, torch.float64) for c in curvatures]
            found = float(torch.stack(scales).mean())
            if found > 0:
                scale = group_state["curvature_scale"] = found
        strategy, _ = self._damping(step.group, group_state)
        return strategy.of(scale or 0.0) + step.group["weight_decay"]

    def _group_reduction_scale(self, step: GroupStep, group_state: dict[str, Any]) -> float:
        """``s`` of a group whose damping follows the loss's reduction: read from the passes of
        this step's window (:meth:`_reduction_scale`) at every step that refreshes a curvature
        of the group, kept in the group state until the next (1, a mean over samples', before
        any: passes run in a ``curvopt.collect`` block of your own hand it no ``s``)."""
        if any([item.fresh is not None for item in step.params]):
            found = self._reduction_scale()
            if found > 0:
                group_state["reduction_scale"] = found
        return group_state.get("reduction_scale", 1.0)

    def _scale_over_ranks(self, step: GroupStep) -> float:
        """The mean of :meth:`_curvature_scale` over the group's curvatures when each rank
        holds those of its own layers (FSDP2, owned state), the parameters replicated on every
        rank counted on rank 0: one all-reduce of ``[Σ, count]`` (0.0 for none)."""
        first = self._distributed.rank == 0
        curvatures = [
            item.curvature
            for item in step.params
            if item.curvature is not None and (item.rows is not None or first)
        ]
        local = [float(sum(float(self._curvature_scale(c)) for c in curvatures)), len(curvatures)]
        total, count = self._distributed.sum(local)
        return total / count if count else 0.0

    def _sharded_layout(self) -> str:
        """Under FSDP2 each sharded parameter's curvature, inverses and direction are its owner
        rank's (``"owned"``, ``optim.distributed.fsdp``), unless a group's step needs the whole
        step everywhere (``"whole"``): adaptive damping (``sᵀCs`` over the group),
        ``orthogonalize`` (after momentum, not element-wise) or ``schedule_free``
        (``opt.eval`` swaps whole state)."""
        owned = self._owned_state and all(
            not self._damping(group, state)[0].adaptive
            and not group["orthogonalize"]
            and group["schedule_free"] is None
            for group, state in zip(self.param_groups, self._group_state)
        )
        return "owned" if owned else "whole"

    def _curvature_scale(self, curvature: Any) -> torch.Tensor:
        """``tr(C)/dim(C)``, the mean eigenvalue of ``curvature`` (a diagonal: its mean)."""
        return curvature.mean()

    def _total_damping(self, group, group_state) -> float:
        """``λ + δ``: the damping of this step plus the weight decay."""
        strategy, damping_state = self._damping(group, group_state)
        return strategy.value(damping_state, group_state["step"]) + group["weight_decay"]

    def _read_curvature(self, update: ParamUpdate, group, attr: str, extension: str):
        """``param.<attr>`` unscaled, checked and recorded in ``update`` (None: missing, with
        fallback), as the plain tensor or list the state keeps."""
        fallback = group["fallback"]
        missing = values.read(update.param, attr) is None
        if fallback is not None and missing and not self._fallback_available(update, group):
            fallback = None  # not one the fallback covers: raise, naming it
        raw = self._read(update, attr, extension, fallback)
        if raw is None:
            return None
        try:
            self._check_curvature(raw, self._view.whole_like(update.param))
        except ValueError as error:
            raise ValueError(f"{update.description}: {error}") from None
        tensors = [raw] if isinstance(raw, torch.Tensor) else list(raw)
        update.checks += [(f"`{attr}`", t) for t in tensors]
        return values.plain(raw)

    def _predicted(self, step: GroupStep) -> float:
        """``q(s) − q(0) = gᵀs + ½ sᵀ(C + δI)s`` summed over the group, ``s = −Δ``."""
        weight_decay, predicted = step.group["weight_decay"], 0.0
        for item in step.params:
            s = -item.update.delta
            model = (item.grad * s).sum() + 0.5 * weight_decay * (s * s).sum()
            if item.curvature is not None:
                model = model + 0.5 * self._quadratic(item.curvature, s)
            predicted += float(model)
        return predicted

    # ----------------------------------------------------------------- adaptive damping
    def _model_due(self) -> list[int]:
        due = []
        for index, (group, group_state) in enumerate(zip(self.param_groups, self._group_state)):
            strategy, _ = self._damping(group, group_state)
            if strategy.adaptive and strategy.due(group_state["step"]):
                due.append(index)
        return due

    def _adapt(self, due, actual, predicted) -> None:
        rho = reduction_ratio(actual, predicted)
        for index in due:
            strategy, damping_state = self._damping(
                self.param_groups[index], self._group_state[index]
            )
            self._group_state[index]["damping"] = strategy.update(damping_state, rho)

    def damping(self, group_index: int = 0) -> float:
        """The damping ``λ`` that the next step of param group ``group_index`` uses (relative
        damping, ``damping=None``: the fraction ``α``)."""
        group, group_state = self.param_groups[group_index], self._group_state[group_index]
        strategy, damping_state = self._damping(group, group_state)
        return strategy.value(damping_state, group_state["step"])


def _device(curvature: Any) -> torch.device:
    """The device of a curvature (a tensor, or a list whose first entry is one)."""
    return (curvature if isinstance(curvature, torch.Tensor) else curvature[0]).device
