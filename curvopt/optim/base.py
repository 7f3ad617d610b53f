"""The base class of curvopt's optimizers: collecting, reading, stepping, checking, saving.

What a step needs is collected by the optimizer itself: the extensions come from its
``_needs(group, group_state)``, per param group, scoped to the group's parameters
(``_requests``); with ``collection="auto"`` an armed ``curvopt.frontend.collection.Collection``
collects them on every backward pass, ``opt.collect()`` opens a ``curvopt.collect`` block.

A step is planned for every parameter first and applied only when the whole plan is valid, so
an error (missing or non-finite quantity, failed inversion) leaves parameters and optimizer
state untouched. Per-parameter state is replaced, never modified in place, so a
``state_dict()`` taken earlier stays a snapshot.

With ``torch.amp.GradScaler`` (``scaler.step(opt)``, also after ``scaler.unscale_(opt)`` and
gradient clipping) the quantities and ``p.grad`` are divided by the loss scale where they carry
it (:mod:`curvopt.optim.loss_scale`, ``curvopt.core.values.unscaled``), so the steps are those
without scaling; ``p.grad`` itself is left as it is. A step whose gradients overflowed
(``inf`` or NaN, as the scaler found) is skipped, as ``torch.optim`` optimizers are skipped by
the scaler.

Under ``torch.distributed`` an optimizer that supports it (``_distributable``) averages the
quantities it collects across ranks and spreads its inversions over them through a
:class:`~curvopt.optim.distributed.DistributedCurvature` (``process_group=``, see there). Under
FSDP2 (``fully_shard``) the step is planned on whole stand-ins of the sharded parameters and
applied to each rank's shard (:class:`~curvopt.optim.distributed.fsdp.FullView`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import warnings
import weakref
from collections.abc import Sequence
from typing import Any, Callable, ClassVar

import torch
from torch.optim import Optimizer

from curvopt import extensions

from curvopt.core import values
from curvopt.core.extended import is_extended, path_of
from curvopt.core.sharded import is_sharded
from curvopt.errors import in_optimizer_terms
from curvopt.frontend.collect import collect
from curvopt.frontend.collection import Collection
from curvopt.optim import distributed
from curvopt.optim.distributed.fsdp import FullView
from curvopt.optim.loss_scale import NONE, LossScale, loss_scale
from curvopt.optim.options import CurvatureOptions, constructor
from curvopt.optim.plan import ParamUpdate, Prepared
from curvopt.optim.state_placement import placed

__all__ = ["CurvatureOptimizer", "ExtensionSpec", "ParamUpdate"]

#: an extension to collect: ``(attr, options)`` for ``curvopt.extensions.extension``
ExtensionSpec = tuple[str, dict[str, Any]]

#: what to change when a step is not finite (the error's last sentence)
REMEDY = "Check the loss, and lower the learning rate (lr)"

#: the end of the error for a sharded (FSDP2) parameter without its quantity
_FSDP_HINT = (
    " Under FSDP2 the automatic collection (collection='auto', one rank) finds a sharded "
    "parameter's module only when curvopt.extend ran after fully_shard: extend the model after "
    "fully_shard, or collect in `with opt.collect():`."
)

#: the start of the warning ``curvopt.collect(skip_unsupported=...)`` gives at every pass
_SKIP_WARNING = r"curvopt\.collect\(skip_unsupported=True\) wrote no Kronecker factors"


class CurvatureOptimizer(Optimizer):
    """A ``torch.optim.Optimizer`` that reads quantities computed by ``curvopt.collect``.

    Subclasses declare their hyper-parameters as ``Options`` (a :mod:`curvopt.optim.options`
    dataclass: defaults and validation of every param group; a class that declares it and no
    ``__init__`` gets the constructor written from it) and implement :meth:`_needs` (the
    extensions a group needs at its next step) and :meth:`_plan_group`.

    By default (``collection="auto"``) the optimizer collects what its next step needs on
    every backward pass that reaches its parameters, with no block::

        loss.backward()              # micro-batches between two steps combine like one batch
        opt.step()

    With ``collection="explicit"`` (or under ``torch.distributed``) there are two equivalent
    ways to take a step (both also work with the default)::

        with opt.collect():          # curvopt.collect(<extensions this optimizer needs>)
            loss.backward()
        opt.step()

        def closure():               # must zero the grads, compute the loss, call backward
            opt.zero_grad()
            loss = lossfunc(model(X), y)
            loss.backward()
            return loss
        opt.step(closure)            # runs the closure inside opt.collect(); returns the loss

    Args:
        params: parameters or param groups, as for ``torch.optim.SGD``.
        defaults: the hyper-parameters of every param group (from ``Options``).
        process_group: under ``torch.distributed`` (optimizers that support it): ``None``
            (the default group if initialized with several ranks), a ``ProcessGroup``, a
            ``DistributedCurvature``, or ``False`` (rank-local).
        collection: ``"auto"`` (default) or ``"explicit"``, as above.

    Raises:
        ValueError: invalid hyper-parameters of a param group, or an unknown ``collection``.

    Example:
        >>> import torch, curvopt
        >>> model = curvopt.extend(torch.nn.Sequential(torch.nn.Linear(3, 2)))
        >>> opt = curvopt.optim.VarianceAdaptedSGD(model.parameters(), lr=0.1)
        >>> isinstance(opt, curvopt.optim.CurvatureOptimizer)
        True
        >>> isinstance(opt, torch.optim.Optimizer)
        True
    """

    #: whether averaging the collected quantities over ranks gives the right step (opt-in)
    _distributable = False
    #: ``GradScaler.step`` sets ``grad_scale`` and ``found_inf`` on it (``optim.loss_scale``)
    _step_supports_amp_scaling = True
    #: the hyper-parameters of a param group, their defaults and validation
    Options: ClassVar[type[CurvatureOptions]] = CurvatureOptions
    #: what to change when a step is not finite (the error's last sentence)
    _remedy: ClassVar[str] = REMEDY
    #: keyword-only constructor arguments besides the hyper-parameters (and process_group)
    _KEYWORDS: ClassVar[dict[str, Any]] = {"collection": "auto"}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "Options" in cls.__dict__ and "__init__" not in cls.__dict__:
            keywords = {"process_group": None} if cls._distributable else {}
            init = super(cls, cls).__init__
            cls.__init__ = constructor(cls.Options, {**keywords, **cls._KEYWORDS}, init)

    def __init__(self, params, defaults: dict[str, Any], process_group=None, collection="auto"):
        self._group_state: list[dict[str, Any]] = []
        self._consumed: dict[torch.Tensor, dict[str, Any]] = {}
        self._loss_scale: LossScale = NONE
        self._view: LocalView | FullView = LocalView()  # FullView once a parameter is sharded
        #: ``(tensors, their ℓ2 norms)`` taken during the step being planned (``_unused``)
        self._normed: list[tuple[list[torch.Tensor], list[float]]] = []
        super().__init__(params, defaults)
        self._distributed = distributed.resolve(
            process_group, self._distributable, type(self).__name__
        )
        self._arm(collection)

    # ----------------------------------------------------------------- hyper-parameters
    def _validate(self, group: dict[str, Any]) -> None:
        """Raise ``ValueError`` for invalid hyper-parameters of ``group`` (without params)."""
        self.Options.of_group(group)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As in ``torch.optim``; the group's hyper-parameters are validated first."""
        options = {k: v for k, v in param_group.items() if k not in ("params", "param_names")}
        self._validate({**self.defaults, **options})
        super().add_param_group(param_group)
        self._group_state.append({"step": 0, "damping": {}})
        if "_collection" in self.__dict__:  # after construction: the new group may collect
            self._collection.follow()

    # ----------------------------------------------------------------- the armed collection
    # ``collection="auto"`` (default): the optimizer owns a
    # ``curvopt.frontend.collection.Collection``, armed from construction, that collects
    # ``_requests()`` on every backward pass reaching its parameters; the window it combines ends at
    # ``step()`` and ``zero_grad()``.
    # ``"explicit"`` (and under ``torch.distributed``): only ``opt.collect()`` and
    # ``opt.step(closure)`` collect, as ``curvopt.collect`` blocks.
    # A window whose step collects nothing (``_requests()`` names no extension: a plain step
    # between curvature refreshes) is known when it starts (the step counter moves at
    # ``step()``); the collection rests through it, and the hooks do nothing.
    def _arm(self, mode: str) -> None:
        if mode not in ("auto", "explicit"):
            raise ValueError(f"collection must be 'auto' or 'explicit', got {mode!r}")
        self._collection_mode = mode
        self._collection = Collection(
            _weak(self._armed_requests), _weak(self._collects), self._terms()
        )
        if mode == "auto" and self._distributed is None:
            self._collection.arm()
        else:  # collects in its blocks: the hooks record while its next step collects
            self._collection.watch()
        if any(group.get("curvature_samples") for group in self.param_groups):
            self._requests()  # an extension without sub-batches raises now, not in a backward

    def _armed_requests(self) -> tuple[list, list[tuple[torch.Tensor, str]], dict[str, Any]]:
        return (*self._requests(), self._collect_options())

    def _collects(self) -> bool:
        """Whether the next step needs any extension (else its window is a plain one)."""
        return any(self._needs(g, s) for g, s in zip(self.param_groups, self._group_state))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As in ``torch.optim``; the armed collection starts a new window too."""
        super().zero_grad(set_to_none)
        self._collection.reset()

    # ----------------------------------------------------------------- collecting
    def _needs(self, group: dict[str, Any], group_state: dict[str, Any]) -> list[ExtensionSpec]:
        """The extensions ``group`` needs for its next step."""
        raise NotImplementedError

    def _requests(self) -> tuple[list, list[tuple[torch.Tensor, str]]]:
        """The extensions the next step needs, and the ``(param, attr)`` pairs they write."""
        made: dict[str, extensions.Extension] = {}
        users: list[tuple[dict[str, Any], str]] = []
        for group, group_state in zip(self.param_groups, self._group_state):
            for attr, options in self._needs(group, group_state):
                if group.get("curvature_samples") is not None:
                    options = {**options, "samples": group["curvature_samples"]}
                wanted = extensions.extension(attr, **options)
                if made.setdefault(attr, wanted).key() != wanted.key():
                    raise ValueError(
                        f"param groups need {made[attr]} and {wanted}, with different options; "
                        "use the same options in all groups"
                    )
                users.append((group, attr))
        targets = [(p, attr) for group, attr in users for p in group["params"] if p.requires_grad]
        return list(made.values()), targets

    def collect(self):
        """``curvopt.collect(...)`` with the extensions the next ``step()`` needs.

        A null context when the next step needs none (e.g. between curvature updates). Under
        ``torch.distributed`` the collected quantities are then averaged over the ranks. With
        the collection armed (the default) a block that adds nothing: the optimizer collects
        on every backward pass anyway.
        """
        exts, targets = self._requests()
        if not exts:
            return contextlib.nullcontext()
        if self._collection.armed:  # it collects without a block: one that adds nothing
            self._collection.window()
            return QuietBlock(self._collection)
        context = collect(*exts, **self._collect_options())
        context.terms = self._terms()
        self._block = context  # its parameters without factors (``skipped``), until the step
        if self._distributed is None:
            return QuietBlock(context)
        sampled = any(getattr(ext, "source", None) == "mc" for ext in exts)
        return self._distributed.collecting(context, targets, sampled)

    def _terms(self) -> Callable[[BaseException], BaseException]:
        """How its collections phrase their errors: the fix by this optimizer's arguments
        (``errors.in_optimizer_terms``; holds no reference to the optimizer)."""
        return functools.partial(
            in_optimizer_terms,
            optimizer=type(self).__name__,
            monte_carlo=self.Options.MONTE_CARLO,
        )

    def _collect_options(self) -> dict[str, Any]:
        """Keyword options of the ``curvopt.collect`` that :meth:`collect` opens."""
        return {}

    def _skipped(self) -> set[str]:
        """The names of the parameters the passes since the last step left without Kronecker
        factors (``collect(skip_unsupported=...)``): the armed collection's and those of
        the block :meth:`collect` opened."""
        block = self.__dict__.get("_block")
        return set(self._collection.skipped) | set(getattr(block, "skipped", None) or ())

    def _raise_non_finite(self, error: Exception) -> None:
        """Raise ``FloatingPointError`` (from ``error``, a factorisation that failed while the
        step was planned) where a gradient of the step, or else a curvature quantity it reads,
        is not finite: that is the cause, and the step's finite check would have named it had
        the plan got that far."""
        reads: dict[int, list[str]] = {}
        for param, attr in self._requests()[1]:
            reads.setdefault(id(param), []).append(attr)
        located = [
            (group, index, param)
            for group in self.param_groups
            for index, param in enumerate(group["params"])
        ]
        gradients = [(g, i, p, "gradient", p.grad) for g, i, p in located]
        quantities = [
            (g, i, p, f"`{attr}`", values.read(p, attr))
            for g, i, p in located
            for attr in reads.get(id(p), ())
        ]
        for group, index, param, what, value in gradients + quantities:
            tensors = [] if value is None else values.plain(value)
            tensors = [tensors] if isinstance(tensors, torch.Tensor) else tensors
            if not all(bool(_entries(t).isfinite().all()) for t in tensors):
                cause = " (the loss exploded, or the backward pass overflowed)"
                raise FloatingPointError(
                    f"{type(self).__name__}: the {what} of "
                    f"{self._describe(group, index, param)} is not finite"
                    f"{cause if what == 'gradient' else ''}; no parameter was updated. "
                    f"{self._remedy}."
                ) from error

    # ----------------------------------------------------------------- reading quantities
    def _describe(self, group: dict[str, Any], index: int, param: torch.Tensor) -> str:
        """``parameter 'name' (shape ...)``, or its position over all groups (as in state_dict)."""
        names = group.get("param_names")
        if names:
            where = repr(names[index])
        else:
            offset = 0
            for other in self.param_groups:
                if other is group:
                    break
                offset += len(other["params"])
            where = f"#{offset + index}"
        return f"parameter {where} (shape {tuple(param.shape)})"

    def _descriptions(self, group: dict[str, Any]) -> list[str]:
        """:meth:`_describe` of each of ``group``'s parameters, formed once and kept
        (``optim.plan.Prepared``) while the group holds the very parameters, of the same shapes
        and names, at the same position among the groups."""
        position, offset = 0, 0
        for other in self.param_groups:
            if other is group:
                break
            position, offset = position + 1, offset + len(other["params"])
        params, names = group["params"], group.get("param_names")
        inputs = (offset, tuple(names) if names else None, [p.shape for p in params])
        prepared = self._prepared()
        found = prepared.get(("descriptions", position), params, inputs)
        if found is None:
            found = [self._describe(group, i, p) for i, p in enumerate(params)]
            prepared.put(("descriptions", position), params, inputs, found)
        return found

    def _prepared(self) -> Prepared:
        """What this optimizer's plain steps derive from its cached state and its param groups
        (``optim.plan.Prepared``: a cache, not saved)."""
        prepared = self.__dict__.get("_prepared_steps")
        if prepared is None:
            prepared = self.__dict__["_prepared_steps"] = Prepared()
        return prepared

    def _unused(self, params: Sequence[torch.Tensor], attrs: Sequence[str]) -> set[int]:
        """The ids of ``params`` that took no part in this step: ``grad`` is None, or all zero
        (after ``zero_grad(set_to_none=False)``) while each of its ``attrs`` is still the one a
        previous step used, or absent (the passes since did not reach it: ``collect`` leaves
        no Kronecker factors of an earlier pass on it). As in ``torch.optim``, such a parameter
        is left unchanged (zero step). The gradients in question are tested together
        (:func:`_all_zero`); their ℓ2 norms are kept for the step's finite check
        (``_normed``), which then does not read them again."""
        held = [(p, p.grad) for p in params]
        sparse = [p for p, g in held if g is not None and g.layout is not torch.strided]
        if sparse:
            param = sparse[0]
            raise TypeError(
                f"{type(self).__name__}: parameter '{path_of(param) or tuple(param.shape)}' "
                f"has a sparse gradient ({param.grad.layout}), which a curvature step cannot "
                "precondition. Build its module with dense gradients (nn.Embedding(..., "
                "sparse=False), the default)."
            )
        unused = {id(p) for p, g in held if g is None}
        used = map(self._consumed.get, params)
        stale = [
            p for (p, g), u in zip(held, used) if g is not None and u and _left_unread(p, u, attrs)
        ]
        grads = [p.grad for p in stale]
        norms = _norms(grads, 2)
        self._normed.append((grads, norms))
        zero = self._view.agreed(_all_zero(grads, norms))  # FSDP2: each rank its part
        return unused | {id(p) for p, z in zip(stale, zero) if z}

    def _read(self, update: ParamUpdate, attr: str, extension: str, fallback: str | None) -> Any:
        """``update.param.<attr>`` as its typed value (``curvopt.core.values``), averaged over the
        ranks and unscaled, or ``None`` when it is missing and a ``fallback`` is set; the object
        read is recorded in ``update.consumed``.

        Raises ``RuntimeError`` when it is missing without fallback, or when it is the very
        object a previous step already used (the backward pass ran outside ``opt.collect()``).
        """
        param, description = update.param, update.description
        value = values.read(param, attr)
        if value is None:
            if fallback is not None:
                return None
            hint = (
                " To update such parameters with the plain (weight-decayed) gradient instead, "
                "pass fallback='sgd' (for all parameters or in their param group)."
            )
            cause = (
                f"Either its module type is not supported by {extension}, the model or the loss "
                "was not passed through curvopt.extend, or the backward pass did not run inside "
                "`opt.collect()` / `opt.step(closure)`."
                if is_extended(param) or self._view.sharded(param) is not param
                else "It belongs to no model passed through curvopt.extend (a copy.deepcopy of "
                "an extended model is a plain model): call curvopt.extend(model) on the model "
                "that holds it, once, before its backward pass."
            )
            raise RuntimeError(
                f"{description} has no `{attr}` after the backward pass, so {type(self).__name__} "
                f"cannot precondition it. {cause}"
                + (hint if "fallback" in self.defaults else "")
                + (_FSDP_HINT if self._view.sharded(param) is not param else "")
            )
        if value is self._consumed.get(param, {}).get(attr):
            raise RuntimeError(
                f"{description}: `{attr}` is the same object a previous step already used, so "
                "the last backward pass did not collect it. Run the backward pass of the "
                "extended model (curvopt.extend; not undone by curvopt.unextend) inside "
                "`with opt.collect():` (or use `opt.step(closure)`) before every step"
            )
        update.consumed[attr] = value
        if self._distributed is not None and self._view.remote(param):
            self._distributed.discard(self._view.sharded(param), attr)  # its owner averages it
        elif self._distributed is not None:  # launched for the sharded parameter (FSDP2)
            value = self._distributed.averaged(self._view.sharded(param), attr, value)
        return values.unscaled(extensions.quantity(attr), value, self._loss_scale.values)

    def _reduction_scale(self) -> float:
        """``s`` of the passes this step reads: the factor by which their losses' reductions
        scale one sample's curvature (``collect.reduction_scale``), from the block
        :meth:`collect` opened or the armed collection's window; divided by a
        ``GradScaler``'s loss scale, as the curvature is (``loss_scale``); under
        ``torch.distributed`` its mean over the ranks, as the curvature's. 0 where none of
        them ran a pass."""
        block = self.__dict__.get("_block")
        scale = (self._collection if block is None else block).reduction_scale
        if self._loss_scale.values is not None:
            scale /= self._loss_scale.values
        return scale if self._distributed is None else self._distributed.mean(scale)

    def _grad(self, param: torch.Tensor) -> torch.Tensor:
        """``param.grad``, divided by the loss scale of a ``GradScaler`` step unless the scaler
        unscaled it already (``loss_scale``)."""
        divisor = self._loss_scale.grad
        return param.grad if divisor is None else param.grad / divisor

    # ----------------------------------------------------------------- stepping
    def _plan_group(
        self, group: dict[str, Any], group_state: dict[str, Any], with_model: bool
    ) -> tuple[list[ParamUpdate], float]:
        """Plan the step of one group without modifying anything.

        Returns the updates and, when ``with_model``, the change ``q(s) − q(0)`` that the
        quadratic model predicts for the objective (0.0 otherwise).
        """
        raise NotImplementedError

    def _model_due(self) -> list[int]:
        """Indices of the groups whose adaptive damping measures ``ρ`` after this step."""
        return []

    def _adapt(self, due: list[int], actual: float, predicted: float) -> None:
        """Update adaptive damping of the groups ``due`` from the measured change."""

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None):
        """Take one step; with a ``closure``, run it inside :meth:`collect` first.

        Raises ``FloatingPointError`` (and changes nothing) if a gradient, a curvature
        quantity or the resulting update is not finite. Returns the closure's loss, or None.
        """
        try:
            if closure is None:
                if not self._collection.skipped:
                    self._collection.check(type(self).__name__)
                else:  # a Kronecker optimizer announces them once itself
                    with quiet_skips():
                        self._collection.check(type(self).__name__)
            # GradScaler.step sets found_inf: outside one there is no loss scale to divide out
            scale = NONE if getattr(self, "found_inf", None) is None else loss_scale(self)
            if scale.overflow:  # as GradScaler skips torch.optim optimizers
                return None
            self._loss_scale = scale
            return self._step(closure)
        finally:
            self._loss_scale = NONE
            self._normed = []
            self._collection.reset()
            self._block = None

    def _step(self, closure):
        loss = None
        if closure is not None:
            with torch.enable_grad(), self.collect():
                loss = closure()
            if loss is not None and not math.isfinite(number(loss)):
                raise FloatingPointError(
                    f"{type(self).__name__}: the loss returned by the closure is "
                    f"{number(loss)}: the loss exploded (non-finite loss); no parameter was "
                    f"updated. {self._remedy}."
                )
        due = self._model_due()
        if due and closure is None:
            raise RuntimeError(
                "adaptive (Levenberg-Marquardt) damping measures the loss after the step: call "
                "opt.step(closure) with a closure that recomputes the loss on the same batch"
            )
        if self._distributed is not None:
            self._distributed.ensure(self._requests()[1])
        self._normed = []
        sharded = self._any_sharded([p for group in self.param_groups for p in group["params"]])
        layout = self._sharded_layout() if self._distributed is not None else "whole"
        if sharded and not isinstance(self._view, FullView):
            self._view = FullView()
        view = self._view.of(self, layout) if sharded else contextlib.nullcontext()
        with view:  # FSDP2: the whole parameters' step, applied to the shards
            try:
                plans = [
                    self._plan_group(group, group_state, with_model=bool(due))
                    for group, group_state in zip(self.param_groups, self._group_state)
                ]
            except torch.linalg.LinAlgError as error:
                self._raise_non_finite(error)
                raise
            updates = [u for group_updates, _ in plans for u in group_updates]
            with self._view.agreeing():  # FSDP2, owned state: raised on every rank
                check_finite(updates, f"{type(self).__name__}: ", self._remedy, self._normed)
            decay_change = regularizer_change(self.param_groups, plans) if due else 0.0
            if updates:  # θ ← θ − Δ, every parameter by one foreach call (element-wise: same bits)
                torch._foreach_sub_([u.param for u in updates], [u.delta for u in updates])
            for update in updates:
                self.state[update.param] = update.state
                if update.consumed:  # (a plain step reads none)
                    self._consumed.setdefault(update.param, {}).update(update.consumed)
        for group_state in self._group_state:
            group_state["step"] += 1
        if due:
            with torch.enable_grad(), self._collection.paused():  # a loss, no curvature
                new_loss = closure()
            actual = number(new_loss) - number(loss)
            if self._distributed is not None:  # the change of the ranks' mean loss
                actual = self._distributed.mean(actual)
            actual += decay_change
            self._adapt(due, actual, sum(predicted for _, predicted in plans))
        return loss

    def _any_sharded(self, params: list[torch.Tensor]) -> bool:
        """Whether any of ``params`` is sharded (FSDP2, ``core.sharded.is_sharded``): looked at
        again only for other parameters (``optim.plan.Prepared``; a tensor's type is its own)."""
        prepared = self._prepared()
        found = prepared.get("sharded", params, ())
        if found is None:
            found = any(is_sharded(p) for p in params)
            prepared.put("sharded", params, (), found)
        return found

    def _sharded_layout(self) -> str:
        """Under FSDP2, where a sharded parameter's state lives (``optim.distributed.fsdp``):
        ``"whole"`` on every rank (default), ``"owned"`` by one owner rank (the rows of
        element-wise buffers on every rank) or ``"rows"`` (an element-wise step: each rank
        its rows of everything)."""
        return "whole"

    def _owner_layout(self) -> dict[str, int] | None:
        """``{"world_size", "rank"}`` when each rank keeps its own part of the state under FSDP2
        (its layers' state, its rows of momentum: :meth:`_sharded_layout`), else None."""
        params = [p for group in self.param_groups for p in group["params"]]
        if self._distributed is None or self._sharded_layout() == "whole":
            return None
        if not any(is_sharded(p) for p in params):
            return None
        return {"world_size": self._distributed.world_size, "rank": self._distributed.rank}

    # ----------------------------------------------------------------- saving
    def state_dict(self) -> dict[str, Any]:
        """As in ``torch.optim``, plus ``"group_state"``: step counters and damping state;
        under FSDP2 with the state kept by owners, ``"fsdp_ranks"``: the rank whose part it
        is, and of how many (:meth:`_owner_layout`)."""
        state_dict = super().state_dict()
        state_dict["group_state"] = copy.deepcopy(self._group_state)
        layout = self._owner_layout()
        if layout is not None:
            state_dict["fsdp_ranks"] = layout
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        group_state = state_dict.pop("group_state", None)
        saved, layout = state_dict.pop("fsdp_ranks", None), self._owner_layout()
        if saved != layout and (saved is not None or state_dict.get("state")):
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: this state was saved as the part of "
                f"{_layout_text(saved)}, but this optimizer keeps the part of "
                f"{_layout_text(layout)}. Load each rank's own state_dict with as many FSDP2 "
                "ranks as saved it (docs/distributed.md, FSDP2 checkpoints)."
            )
        if group_state is None or len(group_state) != len(state_dict["param_groups"]):
            raise ValueError(
                f"this state_dict was not saved by {type(self).__name__}.state_dict() (it has no "
                "'group_state' for every param group)"
            )
        super().load_state_dict(state_dict)
        for param, state in self.state.items():
            self.state[param] = placed(state, param)
        self._group_state = copy.deepcopy(group_state)
        self._consumed = {}
        self._collection.follow()  # the loaded step counters say whether the next step collects

    def __getstate__(self) -> dict[str, Any]:
        state = {**super().__getstate__(), "_group_state": self._group_state}
        state["_collection_mode"] = self._collection_mode
        return {**state, "_distributed": self._distributed}

    def __setstate__(self, state: dict[str, Any]) -> None:
        mode = state.pop("_collection_mode", "auto")
        super().__setstate__(state)
        self.__dict__.setdefault("_consumed", {})
        self.__dict__.setdefault("_distributed", None)
        self.__dict__.setdefault("_loss_scale", NONE)
        self.__dict__.setdefault("_view", LocalView())
        self.__dict__.setdefault("_normed", [])
        self._arm(mode)


class LocalView:
    """The parameters as they are: what an FSDP2 :class:`FullView` answers with nothing
    sharded (each parameter its own, no rows, no owner on another rank, nothing for the ranks
    to agree on). An optimizer holds one until a step finds a sharded parameter and opens a
    ``FullView``, so that a step without FSDP2 reads nothing of it."""

    def sharded(self, param: torch.Tensor) -> torch.Tensor:
        return param

    def rows(self, param: torch.Tensor) -> None:
        return None

    def remote(self, param: torch.Tensor) -> bool:
        return False

    def whole_like(self, param: torch.Tensor) -> torch.Tensor:
        return param

    def rows_of(self, param: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
        return whole

    def agreeing(self):
        return contextlib.nullcontext()

    def agreed(self, flags: list[bool]) -> list[bool]:
        return flags


def _layout_text(layout: dict[str, int] | None) -> str:
    if layout is None:
        return "a whole optimizer (one process, DDP, or FSDP2 with the state on every rank)"
    return f"rank {layout['rank']} of {layout['world_size']} under FSDP2"


def _left_unread(param: torch.Tensor, used: dict[str, Any], attrs: Sequence[str]) -> bool:
    """Whether each of ``attrs`` of ``param`` is none of a pass since the last step: absent, or
    the object a previous step used (``used``: the objects by attribute)."""
    for attr in attrs:
        value = values.read(param, attr)
        if value is not None and value is not used.get(attr):
            return False
    return True


def _all_zero(tensors: Sequence[torch.Tensor], norms: list[float] | None = None) -> list[bool]:
    """Whether every entry of each of ``tensors`` is 0 (NaN is not): ``‖t‖₁ = 0``, a sum of
    absolute values that neither cancels nor underflows (squares would). ``‖t‖₂ > 0`` (or NaN)
    already says no, and its foreach kernel is several times faster on a CPU than the ℓ1 one:
    the ℓ1 norm is taken only of the tensors whose ℓ2 norm is 0 (all zero, or squares that
    underflow). One host read per norm (:func:`_norms`); ``norms``: the ℓ2 norms, where taken
    already."""
    norms = _norms(tensors, 2) if norms is None else norms
    maybe = [i for i, norm in enumerate(norms) if norm == 0]
    if not maybe:
        return [False] * len(tensors)
    out = [False] * len(tensors)
    for i, norm in zip(maybe, _norms([tensors[i] for i in maybe], 1)):
        out[i] = norm == 0
    return out


def _weak(method: Callable[[], Any]) -> Callable[[], Any]:
    """``method()`` through a weak reference (None once its object is gone), so that the
    armed collection does not keep its optimizer alive."""
    ref = weakref.WeakMethod(method)

    def call():
        bound = ref()
        return None if bound is None else bound()

    return call


def skip_options(param_groups, diagonal: bool) -> dict[str, Any]:
    """The ``curvopt.collect`` options for the groups' ``fallback`` (``optim.fallback``): skip
    the parameters without Kronecker factors where a group has one; with ``diagonal``
    (``KFAC``: the engine writes their diagonal) ``"diagonal"`` where a group asks for it."""
    fallbacks = {g["fallback"] for g in param_groups}
    if diagonal and "diagonal" in fallbacks:
        return {"skip_unsupported": "diagonal"}
    return {"skip_unsupported": fallbacks != {None}}


@contextlib.contextmanager
def quiet_skips():
    """A block in which the collection's warning about skipped parameters is silenced (the
    optimizer announces them once instead, ``optim.fallback.announce``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SKIP_WARNING)
        yield


class QuietBlock:
    """``context`` (a ``curvopt.collect`` block or an armed collection) whose exit does not
    warn about skipped parameters (:func:`quiet_skips`); its attributes are ``context``'s."""

    def __init__(self, context):
        self._context = context

    def __getattr__(self, name):
        return getattr(self._context, name)

    def __enter__(self):
        self._context.__enter__()
        return self._context

    def __exit__(self, *exc):
        if not self._context.skipped:
            return self._context.__exit__(*exc)
        with quiet_skips():
            return self._context.__exit__(*exc)


def number(loss) -> float:
    """A loss (tensor or number) as a Python float."""
    return float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)


def regularizer_change(param_groups, plans) -> float:
    """``Σ δ/2 (‖θ − Δ‖² − ‖θ‖²)``: the change of the weight-decay term by the step."""
    change = 0.0
    for group, (updates, _) in zip(param_groups, plans):
        if group["weight_decay"] == 0:
            continue
        for u in updates:
            change += 0.5 * group["weight_decay"] * float((u.delta * (u.delta - 2 * u.param)).sum())
    return change


def _within_range(checks: list[torch.Tensor], params, deltas, normed=()) -> bool:
    """A sufficient condition for every tensor of ``checks`` to be finite and every ``θ − Δ``
    (``params``, ``deltas``: the moved parameters and their steps) to stay finite in ``θ``'s
    dtype: finite Euclidean norms, and ``‖θ‖₂ + ‖Δ‖₂ ≤ max`` of the dtype (the sum in float64;
    ``‖·‖∞ ≤ ‖·‖₂``). A NaN or inf entry makes a norm NaN or inf; a norm that overflows
    where the entries do not only sends the caller to its exact look. The norms of
    ``normed`` (``(tensors, norms)``) are those taken already: a checked tensor among them
    is not read again (and one that is not checked only adds a condition). All the other
    norms by one foreach call per device, read in one host read (:func:`_norms`); the verdict
    on the host, from those floats, by passes over whole lists (no call per tensor)."""
    known = {i for tensors, _ in normed for i in map(id, tensors)}
    checks = [t for t, i in zip(checks, map(id, checks)) if i not in known]
    count, moved = len(checks), len(params)
    norms = _norms([*checks, *params, *deltas], 2)
    if not all(map(math.isfinite, norms[:count])):
        return False
    if not all([all(map(math.isfinite, taken)) for _, taken in normed]):
        return False
    top = {dtype: torch.finfo(dtype).max for dtype in {param.dtype for param in params}}
    limits = [top[param.dtype] for param in params]
    sizes, steps = norms[count : count + moved], norms[count + moved :]
    return all([size + step <= limit for size, step, limit in zip(sizes, steps, limits)])


def _entries(tensor: torch.Tensor) -> torch.Tensor:
    """The stored entries of a sparse tensor (``nn.Embedding(sparse=True)``'s gradient), else
    the tensor."""
    return tensor.coalesce().values() if tensor.is_sparse else tensor


def _by_device(tensors: Sequence[torch.Tensor]) -> dict[torch.device, list[int]]:
    """The positions of ``tensors`` on each of their devices."""
    out: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        out.setdefault(t.device, []).append(i)
    return out


def _norms(tensors: Sequence[torch.Tensor], order: float) -> list[float]:
    """``‖t‖`` of the given ``order`` for each of ``tensors`` (a sparse one through its stored
    entries), in their order, as Python floats (exact: a norm's own dtype widened): one
    foreach norm per device (a fused kernel on a GPU, vectorised on a CPU) and one host read
    of its results."""
    entries = [_entries(t) if t.is_sparse else t for t in tensors]
    if len({t.device for t in entries}) <= 1:  # one device (or none): in the tensors' order
        if not entries:
            return []
        with torch.no_grad():
            return torch.stack(torch._foreach_norm(entries, order)).tolist()
    out = [0.0] * len(tensors)
    with torch.no_grad():
        for at in _by_device(entries).values():
            found = torch._foreach_norm([entries[i] for i in at], order)
            for i, norm in zip(at, torch.stack(found).tolist()):
                out[i] = norm
    return out


def check_finite(
    updates: list[ParamUpdate],
    owner: str = "",
    remedy: str = REMEDY,
    normed: Sequence[tuple[Sequence[torch.Tensor], Sequence[float]]] = (),
) -> None:
    """Raise ``FloatingPointError`` unless every checked tensor, and every parameter after
    its update ``θ − Δ``, is finite (``‖θ‖∞ + ‖Δ‖∞ ≤ max`` of the dtype: no overflow).
    ``normed``: ``(tensors, their ℓ2 norms)`` taken already in this step (the gradients that
    ``_unused`` tested), not read again."""
    checks = [(u, what, t) for u in updates for what, t in u.checks]
    moved = [u for u in updates if u.delta is not None]
    if not checks and not moved:
        return
    # one read per tensor and one host sync; only a non-finite norm (or overflow) is looked into.
    # A checked tensor that is a step Δ itself is read once: the range test needs its norm finite
    params, deltas = [u.param for u in moved], [u.delta for u in moved]
    steps, tensors = set(map(id, deltas)), [t for _, _, t in checks]
    if _within_range(
        [t for t, i in zip(tensors, map(id, tensors)) if i not in steps], params, deltas, normed
    ):
        return
    after = [(u, "parameter after the step", (u.param - u.delta).to(u.param.dtype)) for u in moved]
    for update, what, tensor in checks + after:
        if not bool(_entries(tensor).isfinite().all()):
            cause = (
                " (the loss exploded, or the backward pass overflowed)"
                if what == "gradient"
                else ""
            )
            raise FloatingPointError(
                f"{owner}the {what} of {update.description} is not finite{cause}; no "
                f"parameter was updated. {remedy}."
            )
