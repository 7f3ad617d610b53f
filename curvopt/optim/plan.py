"""The planned step of one parameter, and the checks over a whole plan (``optim.base``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ParamUpdate:
    """The planned change of one parameter: ``θ ← θ − delta`` and its new ``state``."""

    param: torch.Tensor
    description: str
    delta: torch.Tensor | None = None
    state: dict[str, Any] = field(default_factory=dict)
    #: ``(what, tensor)`` pairs that must be finite for the step to be taken
    checks: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    #: the quantity objects read from the parameter (to detect stale ones next time)
    consumed: dict[str, Any] = field(default_factory=dict)


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


def describe(param_groups, group: dict[str, Any], index: int, param: torch.Tensor) -> str:
    """``parameter 'name' (shape ...)``, or its position over all groups (as in state_dict)."""
    names = group.get("param_names")
    if names:
        where = repr(names[index])
    else:
        offset = 0
        for other in param_groups:
            if other is group:
                break
            offset += len(other["params"])
        where = f"#{offset + index}"
    return f"parameter {where} (shape {tuple(param.shape)})"


def check_finite(updates: list[ParamUpdate]) -> None:
    """Raise ``FloatingPointError`` naming the first of the updates' ``checks`` that is not
    finite (one host sync when all are)."""
    checks = [(u, what, t) for u in updates for what, t in u.checks]
    if not checks:
        return
    device = checks[0][2].device
    # one read per tensor and one host sync: a finite sum means finite entries (a NaN or
    # inf entry makes the sum NaN or inf); only a non-finite sum (or overflow) is looked into
    sums = torch.stack([t.sum().to(device) for _, _, t in checks])
    if bool(sums.isfinite().all()):
        return
    flags = [t.isfinite().all().to(device) for _, _, t in checks]
    if bool(torch.stack(flags).all()):
        return
    for (update, what, _), flag in zip(checks, flags):
        if not flag:
            cause = (
                " (the loss exploded, or the backward pass overflowed)"
                if what == "gradient"
                else ""
            )
            raise FloatingPointError(
                f"the {what} of {update.description} is not finite{cause}; no parameter was "
                "updated. Check the loss and the learning rate, or increase the damping."
            )
