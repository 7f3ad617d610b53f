"""``d ← ν d`` with ``ν = min(1, sqrt(κ / (lr² Σ gᵀd)))`` over the group (``kl_clip`` κ; off
for ``None``): the step's length in the damped curvature is at most ``κ``."""

from __future__ import annotations

from curvopt.optim.stages.base import GroupStep, Stage
from curvopt.optim.transforms import kl_clip_factor


class ScaleByTrustRegion(Stage):
    order = 40

    def __call__(self, step: GroupStep) -> None:
        kl_clip = step.group["kl_clip"]
        if kl_clip is None:
            return
        items = step.params
        nu = kl_clip_factor(
            [i.grad for i in items], [i.direction for i in items], step.group["lr"], kl_clip
        )
        if nu != 1.0:
            for item in items:
                item.direction = item.direction * nu
