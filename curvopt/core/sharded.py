"""FSDP2 (``torch.distributed.fsdp.fully_shard``): the sharded parameter behind the one a pass sees.

``fully_shard`` replaces each parameter of a module by a sharded ``DTensor`` parameter (rank
``r`` holds rows ``r·⌈d₀/K⌉ …`` of dim 0) and, for its forward and backward, puts a gathered
*unsharded* parameter (a plain ``nn.Parameter`` of the full shape, the same object at every
step) in the module's place. Which of the two a backward pass finds on a module depends on
when FSDP2 reshards it (after the forward by default; never for the root module): curvopt
keeps them all gathered from the loss on (:class:`Gathered`: the curvature's columns are
propagated through every layer there, before FSDP2 gathers each module for its own backward),
computes with the gathered parameters, and writes every quantity on the sharded parameter, the
one the user and the optimizer hold (``engine.results``).

:func:`sharded_index` maps the unsharded parameters of the models a pass went through to
their sharded ones; :func:`tied_gathered` names those FSDP2 puts on several modules (a tied
weight, whose uses' per-sample gradients the pass sums). They read FSDP2's per-module state
(``FSDPModule._get_fsdp_state()``, its parameter groups' ``FSDPParam``\\ s:
``_unsharded_param``, ``sharded_param``, ``_module_info``; the groups'
``reshard_after_backward`` and ``_training_state`` for :class:`Gathered`), private API checked
when read: an ``FSDPParam`` whose two parameters disagree in shape, whose sharded parameter is
not a ``DTensor``, or without its modules' list, raises ``RuntimeError`` (the installed torch
changed them).
"""

from __future__ import annotations

from typing import Dict, Iterable, Set

import torch
from torch import nn

try:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch built without torch.distributed: no FSDP2 to map
    FSDPModule = DTensor = TrainingState = None

__all__ = ["Gathered", "any_fully_sharded", "is_sharded", "sharded_index", "tied_gathered"]


def is_sharded(p: torch.Tensor) -> bool:
    """Whether ``p`` is a ``DTensor`` (FSDP2's sharded parameters are)."""
    return DTensor is not None and isinstance(p, DTensor)


def any_fully_sharded() -> bool:
    """Whether a ``fully_shard``-ed module can exist in this process: ``fully_shard`` gives a
    module a class of its own derived from ``FSDPModule``, so where ``FSDPModule`` has no
    subclass alive no module is one, and the walks of a model's modules that look for them
    (:func:`sharded_index`, :func:`tied_gathered`, :meth:`Gathered.hold`) would find none.
    (Once ``fully_shard`` ran in the process its classes stay: the walks run.)"""
    return FSDPModule is not None and bool(FSDPModule.__subclasses__())


def _param_groups(module: nn.Module) -> list:
    """The FSDP2 parameter groups of a ``fully_shard``-ed module (none: it holds no parameter)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # an older torch: one group or None
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return list(groups)


def _fsdp_params(models: Iterable[nn.Module]):
    """The ``FSDPParam``\\ s of the ``fully_shard``-ed modules of ``models``."""
    if not any_fully_sharded():
        return
    for model in models:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                for group in _param_groups(module):
                    yield from group.fsdp_params


def sharded_index(models: Iterable[nn.Module]) -> Dict[int, torch.Tensor]:
    """``id(unsharded) -> sharded``: the parameters FSDP2 gathered for the computation in
    ``models`` (only those gathered at least once), each mapped to its sharded ``DTensor``
    parameter; empty without ``fully_shard``.

    Raises:
        RuntimeError: FSDP2's internals no longer hold what this reads.
    """
    index: Dict[int, torch.Tensor] = {}
    for fsdp_param in _fsdp_params(models):
        unsharded = fsdp_param.__dict__.get("_unsharded_param")
        if unsharded is None:
            continue
        sharded = getattr(fsdp_param, "sharded_param", None)
        if not is_sharded(sharded) or sharded.shape != unsharded.shape:
            raise RuntimeError(
                "curvopt cannot map an FSDP2 parameter gathered for the computation to "
                "its sharded DTensor parameter: this torch's FSDPParam no longer holds "
                "`_unsharded_param` and `sharded_param` of one shape. Use a torch "
                "version curvopt supports (see docs/distributed.md#fsdp2)."
            )
        index[id(unsharded)] = sharded
    return index


def tied_gathered(models: Iterable[nn.Module]) -> Set[int]:
    """``id``\\ s of the gathered parameters FSDP2 puts on more than one module of ``models``
    (a tied weight: ``FSDPParam._module_info.shared_modules``). ``extend`` noted the modules
    holding the parameters it saw (``core.params.tied``), not these new objects.

    Raises:
        RuntimeError: FSDP2's internals no longer hold what this reads.
    """
    found: Set[int] = set()
    for fsdp_param in _fsdp_params(models):
        unsharded = fsdp_param.__dict__.get("_unsharded_param")
        if unsharded is None:
            continue
        info = getattr(fsdp_param, "_module_info", None)
        if not isinstance(getattr(info, "shared_modules", None), list):
            raise RuntimeError(
                "curvopt cannot tell whether an FSDP2 parameter is tied: this torch's "
                "FSDPParam no longer holds `_module_info.shared_modules`. Use a torch version "
                "curvopt supports (see docs/distributed.md#fsdp2)."
            )
        if info.shared_modules:
            found.add(id(unsharded))
    return found


class Gathered:
    """The ``fully_shard``-ed modules one backward pass keeps gathered (:meth:`hold`) until it
    ends (:meth:`release`).

    The pass propagates the curvature's columns through every layer when it reaches the loss,
    with nested ``torch.autograd.grad`` calls. Those run FSDP2's backward hooks too, and its
    end-of-backward callback (queued by them) reshards every module when the first nested
    call returns. So :meth:`hold` gathers each module (``FSDPModule.unshard``, a collective:
    every rank's pass holds the same modules in the same order) with resharding after the
    backward off (``set_reshard_after_backward(False)``), and :meth:`release` restores each
    parameter group's setting and reshards the groups that finished their backward meanwhile
    (their inputs needed gradients); FSDP2's own end-of-backward callback, which runs after
    the pass's, reshards the others.
    """

    def __init__(self):
        self._held: Dict[int, tuple] = {}  # id(module): (module, its groups' settings)

    def hold(self, models: Iterable[nn.Module]) -> None:
        """Gather the ``fully_shard``-ed modules of ``models`` not held yet."""
        if not any_fully_sharded():
            return
        for model in models:
            for module in model.modules():
                if not isinstance(module, FSDPModule) or id(module) in self._held:
                    continue
                settings = [group.reshard_after_backward for group in _param_groups(module)]
                self._held[id(module)] = (module, settings)
                module.set_reshard_after_backward(False, recurse=False)
                module.unshard()

    def release(self) -> None:
        """Restore the modules' resharding after the backward, and reshard (as FSDP2 would
        have) the groups that finished their backward meanwhile."""
        for module, settings in self._held.values():
            for group, setting in zip(_param_groups(module), settings):
                group.reshard_after_backward = setting
                if setting and group._training_state is TrainingState.POST_BACKWARD:
                    group.reshard()
        self._held.clear()
