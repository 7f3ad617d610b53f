"""``v ← μ v + d`` (``momentum`` μ; ``v = d`` at the first step), kept in ``state["momentum"]``
when ``μ > 0``."""

from __future__ import annotations

from curvopt.optim.stages.base import GroupStep, Stage
from curvopt.optim.transforms import momentum


class TraceMomentum(Stage):
    order = 50
    identity_at = ("momentum", 0)

    def __call__(self, step: GroupStep) -> None:
        mu = step.group["momentum"]
        for item in step.params:
            velocity = momentum(item.state.get("momentum"), item.direction, mu)
            if mu > 0:
                if velocity is item.grad:  # the gradient itself (fallback 'sgd'): kept, so copied
                    velocity = velocity.clone()
                item.update.state["momentum"] = velocity
                item.own = None  # the state keeps it
            item.direction = velocity
