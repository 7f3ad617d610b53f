"""``d = (C + (λ + δ) I)⁻¹ g`` through the group's ``Preconditioner``: its ``direction`` for a
parameter with curvature ``C`` (diagonal, Kronecker, eigen-corrected), its ``fallback`` for one
without. The new state holds ``C`` and the step it is from, and the cached derived quantity
(inverse, eigendecomposition) that ``direction`` returns.

Under ``torch.distributed`` the derived quantities that are due (``_derived``) are first
computed each on one rank and broadcast (``DistributedCurvature.spread``), then put into the
state ``_direction`` reads, where ``cached`` finds them current. Under FSDP2 with the state kept
by owners (``ParamStep.rows``) a sharded parameter's owner computes them and its whole
direction alone, and every rank then receives its rows of it (``distributed.fsdp.exchange``).

The optimizers' ``_directions`` apply their curvature type's ``DampedInverse``
(``inversion.inverses``; ``inversion.kronecker.KroneckerInverse``), which ``curvopt.linalg``'s
``inverse`` operators apply too: ``KFAC`` and ``EKFAC`` apply the blocks of equal shapes
together on an accelerator (``optim.plan.Stacks``), ``DiagGGNNewton`` all of them by
``torch._foreach`` calls, the others one parameter at a time.
"""

from __future__ import annotations


import torch

from curvopt.optim.plan import cached
from curvopt.optim.distributed import Job, inversion_cost
from curvopt.optim.distributed.fsdp import exchange
from curvopt.optim.stages.base import GroupStep, Stage


class Precondition(Stage):
    order = 30

    def __call__(self, step: GroupStep) -> None:
        preconditioner = step.preconditioner
        if preconditioner.distributed is not None:
            _spread_derived(step)
        sharded = any([item.rows is not None for item in step.params])
        failure = None
        try:
            _directions(step)
        except Exception as error:  # noqa: BLE001 (FSDP2: raised on every rank by the exchange)
            if not sharded:
                raise
            failure = error
        if sharded:  # FSDP2, owned state: each rank its rows of every direction
            exchange(step.params, failure, preconditioner.distributed)
        for item in step.params:
            aliased = _aliases(item.direction, item.grad, item.update.param)
            item.own = None if aliased else item.direction


def _directions(step: GroupStep) -> None:
    """The direction and new state of every item this rank computes (all but those of
    parameters another rank owns under FSDP2)."""
    preconditioner, curved = step.preconditioner, []
    for item in step.params:
        if item.rows is not None and not item.rows.mine:
            continue  # its owner computes it
        if item.curvature is None:
            item.direction, item.update.state = preconditioner.fallback(item, step)
        else:
            curved.append(item)
    for item, (direction, state) in zip(curved, preconditioner.directions(curved, step)):
        item.direction, item.update.state = direction, state
        state.update(curvature=item.curvature, curvature_step=item.curvature_step)


def _aliases(direction: torch.Tensor, grad: torch.Tensor, param: torch.Tensor) -> bool:
    """Whether ``direction`` shares memory with the gradient in use, ``param.grad`` or the
    parameter (the fallback ``'sgd'`` returns the gradient itself): then no stage may change
    it in place."""
    memory = direction.untyped_storage().data_ptr()
    held = param.grad
    for other in (grad, param) if held is grad else (grad, held, param):
        if other is not None and other.untyped_storage().data_ptr() == memory:
            return True
    return False


def _spread_derived(step: GroupStep) -> None:
    """Compute the due derived quantities on their ranks and put them into the items' state."""
    preconditioner, due = step.preconditioner, []  # (item, Derived)
    for item in step.params:
        if item.curvature is None or item.rows is not None:  # (FSDP2: its owner's own)
            continue
        derived = preconditioner.derived(
            item.curvature, step.group, step.damping, item.curvature_step
        )
        if derived is None:
            continue
        old = item.state.get(derived.name)
        if cached(old, derived.key, step.step, derived.interval, lambda: None) is not old:
            due.append((item, derived))
    jobs = [
        Job(item.update.description, d.compute, d.empty, inversion_cost(item.curvature))
        for item, d in due
    ]
    values = preconditioner.distributed.spread(jobs)
    for (item, derived), value in zip(due, values):
        entry = {"value": value, "key": derived.key, "step": step.step}
        item.state = {**item.state, derived.name: entry}
