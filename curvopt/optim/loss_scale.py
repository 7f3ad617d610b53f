"""The loss scale of a ``torch.amp.GradScaler`` step, as the optimizers divide it out.

``scaler.scale(loss).backward()`` multiplies ``p.grad`` and every collected quantity by the
scale ``S`` (each to its power, ``Quantity.loss_scale_power``). ``scaler.step(opt)`` hands a
curvopt optimizer (``_step_supports_amp_scaling``) two attributes during ``step``:
``found_inf`` (an overflow: the step is skipped) and ``grad_scale``: ``S``, or ``None`` where
``scaler.unscale_(opt)`` ran first (Hugging Face's Trainer, accelerate's ``clip_grad_norm_``,
Lightning's ``16-mixed``): then ``p.grad`` is already divided by ``S`` (and possibly clipped),
while the quantities still carry ``S``. The scale is then read from the scaler whose ``step``
is calling the optimizer's (:func:`stepping_scaler`); it has not changed since the backward
pass (``scaler.update()`` comes after ``step``). So:

* ``values``: the divisor of the quantities, ``S`` in either case;
* ``grad``: the divisor of ``p.grad``, ``S`` or ``None`` (unscaled by the scaler already, so
  that clipping after ``unscale_`` is kept: the step is that of the same clipping unscaled).

A loss weight of the user's own (``0.5 * loss``) is part of the objective and stays in the
quantities, as without a scaler.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossScale:
    """The divisors of one step (``None``: nothing to divide); ``overflow``: skip the step."""

    values: float | None = None
    grad: float | None = None
    overflow: bool = False

    @property
    def divided_already(self) -> float:
        """The factor ``p.grad`` was divided by before ``step``, relative to the backward
        pass's (``S`` after ``scaler.unscale_``, else 1)."""
        return self.values if self.values is not None and self.grad is None else 1.0


NONE = LossScale()


def stepping_scaler() -> torch.amp.GradScaler | None:
    """The ``torch.amp.GradScaler`` whose ``step`` is running on this thread (it calls the
    optimizer's ``step``, through torch's and frameworks' wrappers), or ``None``."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "step":
            owner = frame.f_locals.get("self")
            if isinstance(owner, torch.amp.GradScaler):
                return owner
        frame = frame.f_back
    return None


def loss_scale(optimizer) -> LossScale:
    """The loss scale of the running ``optimizer.step()`` under ``GradScaler.step`` (which set
    ``optimizer.found_inf``; outside one the optimizers use :data:`NONE` without calling this)."""
    if bool(optimizer.found_inf.sum() > 0):
        return LossScale(overflow=True)
    grad_scale = getattr(optimizer, "grad_scale", None)
    if grad_scale is not None:
        return LossScale(float(grad_scale), float(grad_scale))
    scaler = stepping_scaler()
    if scaler is None:
        raise RuntimeError(
            f"{type(optimizer).__name__} under GradScaler: p.grad was unscaled before step "
            "(scaler.unscale_(opt)), and the scaler calling step could not be found to "
            "unscale the curvature of the same backward pass; call scaler.step(opt) directly"
        )
    return LossScale(float(scaler.get_scale()))
