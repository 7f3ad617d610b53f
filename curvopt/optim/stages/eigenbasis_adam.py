"""Adam in the eigenbasis of the Kronecker factors (``EigenAdam``; SOAP, Vyas et al. 2024, with
the basis of :mod:`~curvopt.optim.stages.eigenbasis`).

Per parameter, with its basis ``Q = Q_B ⊗ Q_A`` (the identity for a parameter without one),
``t`` its count of Adam steps and ``(β1, β2) = betas``::

    G' = Q_Bᵀ G Q_A                                  [dim B, dim A], G = g as [dim B, -1]
    m ← β1 m + (1 − β1) G'                           m = v = 0 before the first step
    v ← β2 v + (1 − β2) G' ⊙ G'
    U' = (m / (1 − β1ᵗ)) / (sqrt(v / (1 − β2ᵗ)) + ε)
    d = Q_B U' Q_Aᵀ                                  shaped as the parameter

``m``, ``v`` and ``t`` are kept in the state (``exp_avg``, ``exp_avg_sq``, ``adam_step``,
parameter-shaped as ``torch.optim.Adam``'s; the basis stage carries ``m`` and ``v`` into a new
basis). In the identity basis this is ``torch.optim.Adam``'s direction, computed as it does
(``denom = sqrt(v) / sqrt(1 − β2ᵗ) + ε``, ``d = (m / denom) / (1 − β1ᵗ)``).
"""

from __future__ import annotations

import math

import torch


from curvopt.optim.stages.base import GroupStep, Stage
from curvopt.optim.stages.eigenbasis import rotate


class EigenbasisAdam(Stage):
    """``d = Q_B U' Q_Aᵀ``, ``U'`` Adam's bias-corrected step from the moments of the rotated
    gradients ``G' = Q_Bᵀ G Q_A`` (see the module); the basis is the one the basis stage
    keeps (``update.state`` on a basis step, else ``state["eigenbasis"]``), none for a
    parameter without curvature."""

    order = 30

    def __call__(self, step: GroupStep) -> None:
        beta1, beta2 = step.group["betas"]
        eps = step.group["eps"]
        for item in step.params:
            bases = _latest(item, "eigenbasis") or []
            count = item.state.get("adam_step", 0) + 1
            grad = rotate(bases, item.grad)
            m, v = _latest(item, "exp_avg"), _latest(item, "exp_avg_sq")
            m = (torch.zeros_like(grad) if m is None else m).lerp(grad, 1 - beta1)
            v = (torch.zeros_like(grad) if v is None else v * beta2).addcmul_(
                grad, grad, value=1 - beta2
            )
            denom = (v.sqrt() / math.sqrt(1 - beta2**count)).add_(eps)
            direction = rotate(bases, (m / denom).div_(1 - beta1**count), back=True)
            item.update.state.update(exp_avg=m, exp_avg_sq=v, adam_step=count)
            item.direction = item.own = direction.to(item.grad.dtype)


def _latest(item, key: str):
    """``key`` as the basis stage set it at this step (``update.state``), else as stored."""
    return item.update.state.get(key, item.state.get(key))
