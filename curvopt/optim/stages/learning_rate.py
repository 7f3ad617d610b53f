"""``Δ = lr · v``: the change ``θ ← θ − Δ`` of every parameter (checked to be finite)."""

from __future__ import annotations

from curvopt.optim.stages.base import GroupStep, Stage


class ScaleByLearningRate(Stage):
    order = 60

    def __call__(self, step: GroupStep) -> None:
        lr = step.group["lr"]
        for item in step.params:
            item.update.delta = item.scaled(lr)
            item.update.checks.append(("update", item.update.delta))
