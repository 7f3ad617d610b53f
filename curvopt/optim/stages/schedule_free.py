"""Schedule-free averaging of the damped Newton step (``schedule_free`` β; no stage for
``None``): Defazio et al. 2024, "The Road Less Scheduled", Algorithm 1, with the Newton
direction in place of the gradient.

Per parameter, three sequences: ``z`` (the base iterate, stepped by the update ``u = lr · v``
of the stages before), ``x`` (the weighted average of the ``z``) and ``y`` (where the gradient
and the curvature are taken: the parameter itself while training)::

    z ← z − u
    x ← (1 − c) x + c z          c = w_t / Σ_{s≤t} w_s,  w_t = (max_{s≤t} lr_s)²
    y = (1 − β) z + β x

The stage turns ``u`` into the parameter's change ``Δ = y − y_new = c (y − z) + (1 − β (1 − c)) u``
and keeps ``z`` and the weights in ``state["schedule_free"]``; ``x`` is not stored:
``x = (y − (1 − β) z) / β`` (:func:`average`). At the first step ``z = x = y``, so ``c = 1``
and ``Δ = u``. The weights are those of ``schedulefree`` 1.4.1 with ``r = 0`` and
``weight_lr_power = 2`` (its warm-up is the lr schedule's, which sets ``lr``).

Evaluate at ``x``: ``opt.eval()`` puts ``x`` into the parameters, ``opt.train()`` puts ``y``
back (``NewtonOptimizer.eval`` / ``train``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from curvopt.optim.stages.base import GroupStep, Stage

#: the state key of a parameter's ``{"z": tensor, "weight_sum": float, "lr_max": float}``
KEY = "schedule_free"


class ScheduleFree(Stage):
    order = 70
    identity_at = ("schedule_free", None)

    def __call__(self, step: GroupStep) -> None:
        beta, lr = step.group["schedule_free"], step.group["lr"]
        if beta is None:  # the plain step (a chain that runs every stage)
            return
        for item in step.params:
            update, kept = item.update, item.state.get(KEY)
            y = update.param.detach()
            z = y if kept is None else kept["z"]
            lr_max = max(lr, 0.0 if kept is None else kept["lr_max"])
            weight_sum = lr_max**2 + (0.0 if kept is None else kept["weight_sum"])
            c = lr_max**2 / weight_sum if weight_sum > 0 else 0.0
            u = update.delta  # a non-finite u makes Δ non-finite: the plan's check of Δ
            update.state[KEY] = {"z": z - u, "weight_sum": weight_sum, "lr_max": lr_max}
            if kept is not None:  # else c = 1 and y = z: Δ = u
                # k u + c y − c z: three passes over the parameter's size (a memory-bound step:
                # fc1 of 2C2D is 3.2M), on u itself where the step owns it
                k = 1 - beta * (1 - c)
                start = u.mul_(k) if item.owns(u) else u * k
                update.delta = item.own = start.add_(y, alpha=c).sub_(z, alpha=c)


def average(param: torch.Tensor, state: dict[str, Any], beta: float) -> torch.Tensor:
    """``x = (y − (1 − β) z) / β`` of ``param`` (its training value ``y``), or ``param``
    itself before its first schedule-free step."""
    kept = state.get(KEY)
    return param if kept is None else (param - (1 - beta) * kept["z"]) / beta


def gradient_point(average: torch.Tensor, state: dict[str, Any], beta: float) -> torch.Tensor:
    """``y = (1 − β) z + β x`` from the average ``x`` (the inverse of :func:`average`)."""
    kept = state.get(KEY)
    return average if kept is None else (1 - beta) * kept["z"] + beta * average


@torch.no_grad()
def swap(group: dict[str, Any], state, to: Callable) -> None:
    """Replace every parameter ``p`` of the param group (with ``schedule_free`` β) by ``to(p,
    its state, β)`` (:func:`average` or :func:`gradient_point`), in place."""
    for p in group["params"]:
        p.copy_(to(p, state.get(p, {}), group["schedule_free"]))
