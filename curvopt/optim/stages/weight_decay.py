"""``g ← g + δθ``: the gradient of ``L + δ/2 ‖θ‖²`` (``weight_decay`` δ)."""

from __future__ import annotations

from curvopt.optim.stages.base import GroupStep, Stage
from curvopt.optim.transforms import add_weight_decay


class AddWeightDecay(Stage):
    order = 10
    identity_at = ("weight_decay", 0)

    def __call__(self, step: GroupStep) -> None:
        weight_decay = step.group["weight_decay"]
        for item in step.params:
            item.grad = add_weight_decay(item.grad, item.update.param, weight_decay)
