"""``Δ = lr · v``: the change ``θ ← θ − Δ`` of every parameter (checked to be finite); the
directions the step owns scaled in place by one ``torch._foreach_mul_`` (element-wise: the
bits of a ``mul_`` each)."""

from __future__ import annotations

from curvopt.optim.stages.base import GroupStep, Stage, scaled_directions


class ScaleByLearningRate(Stage):
    order = 60

    def __call__(self, step: GroupStep) -> None:
        for item, delta in zip(step.params, scaled_directions(step.params, step.group["lr"])):
            item.update.delta = delta
            item.update.checks.append(("update", delta))
