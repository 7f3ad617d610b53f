"""``Δ = lr · v``: the change ``θ ← θ − Δ`` of every parameter (checked to be finite); the
directions the step owns scaled in place by one ``torch._foreach_mul_`` (element-wise: the
bits of a ``mul_`` each)."""

from __future__ import annotations

import torch

from curvopt.optim.stages.base import GroupStep, Stage


class ScaleByLearningRate(Stage):
    order = 60

    def __call__(self, step: GroupStep) -> None:
        lr = step.group["lr"]
        owns = [item.owns(item.direction) for item in step.params]
        owned = [item.direction for item, own in zip(step.params, owns) if own]
        if owned:
            torch._foreach_mul_(owned, lr)
        for item, own in zip(step.params, owns):
            item.update.delta = item.direction if own else item.scaled(lr)
            item.update.checks.append(("update", item.update.delta))
