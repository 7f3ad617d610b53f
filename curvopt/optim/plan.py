"""The planned step of one parameter, the cache entries its state keeps, and the checks over a
whole plan (``optim.base``).

A cache entry (:func:`cached`: inverses, eigendecompositions) is the plain dict
``{"value": ..., "key": ..., "step": int}`` so that it can live in an optimizer's ``state``
and be saved with ``state_dict``.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

#: what to change when a step is not finite (the error's last sentence)
REMEDY = "Check the loss, and lower the learning rate (lr)"


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


CacheEntry = dict[str, Any]


def cached(
    entry: CacheEntry | None,
    key: Hashable,
    step: int,
    interval: int,
    compute: Callable[[], Any],
) -> CacheEntry:
    """The cache entry to use at ``step``: ``entry`` itself, or a new one holding ``compute()``.

    ``compute`` runs when there is no entry, or when the inputs changed (``key`` differs from
    ``entry["key"]``) and at least ``interval`` steps passed since ``entry["step"]``. So with
    ``interval = m`` an inverse is recomputed at most every ``m`` steps, and never while its
    inputs (e.g. curvature version, damping) stay the same. ``entry`` is not modified.

    Args:
        entry: the previous entry ``{"value", "key", "step"}``, or ``None``.
        key: what the value depends on (compared with ``!=``).
        step: the current step count.
        interval: the least number of steps between two computations.
        compute: a callable returning the new value.

    Returns:
        The entry (a dict with ``"value"``, ``"key"`` and ``"step"``).

    Example:
        >>> from curvopt.optim import cached
        >>> entry = cached(None, key="a", step=0, interval=2, compute=lambda: 1)
        >>> cached(entry, key="b", step=1, interval=2, compute=lambda: 2)["value"]  # too early
        1
        >>> cached(entry, key="b", step=2, interval=2, compute=lambda: 2)["value"]
        2
    """
    if entry is None or (entry["key"] != key and step - entry["step"] >= interval):
        return {"value": compute(), "key": key, "step": step}
    return entry


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


def _size(tensor: torch.Tensor) -> torch.Tensor:
    """``‖t‖∞ = max(−min t, max t)`` in float64 (inf or NaN for non-finite entries; 0 for no
    entries): one pass of ``aminmax`` (exact, and cheaper than ``vector_norm`` with a float64
    ``dtype``, which converts every entry)."""
    if tensor.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=tensor.device)
    low, high = torch.aminmax(tensor.detach())
    return torch.maximum(-low, high).to(torch.float64)


def check_finite(updates: list[ParamUpdate], owner: str = "", remedy: str = REMEDY) -> None:
    """Raise ``FloatingPointError`` unless every checked tensor, and every parameter after
    its update ``θ − Δ``, is finite (``‖θ‖∞ + ‖Δ‖∞ ≤ max`` of the dtype: no overflow)."""
    checks = [(u, what, t) for u in updates for what, t in u.checks]
    moved = [u for u in updates if u.delta is not None]
    if not checks and not moved:
        return
    device = (checks[0][2] if checks else moved[0].param).device
    # one read per tensor and one host sync: a finite sum means finite entries (a NaN or
    # inf entry makes the sum NaN or inf); only a non-finite sum (or overflow) is looked into
    sums = [t.sum().to(device) for _, _, t in checks]
    sizes = [_size(u.param) + _size(u.delta) - torch.finfo(u.param.dtype).max for u in moved]
    fine = torch.stack(sums).isfinite().all() if sums else torch.tensor(True, device=device)
    if sizes:
        fine = fine & (torch.stack([size.to(device) for size in sizes]) <= 0).all()
    if bool(fine):
        return
    after = [(u, "parameter after the step", (u.param - u.delta).to(u.param.dtype)) for u in moved]
    for update, what, tensor in checks + after:
        if not bool(tensor.isfinite().all()):
            cause = (
                " (the loss exploded, or the backward pass overflowed)"
                if what == "gradient"
                else ""
            )
            raise FloatingPointError(
                f"{owner}the {what} of {update.description} is not finite{cause}; no "
                f"parameter was updated. {remedy}."
            )
