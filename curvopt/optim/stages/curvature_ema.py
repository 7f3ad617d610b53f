"""``C ← β C + (1 − β) C_new`` (``curvature_ema`` β) for the curvature read at this step,
``C`` the stored average; between curvature steps the stored ``C`` is used as it is. For
``β = 0`` the curvature read is used as it is, with no stage (``identity_at``)."""

from __future__ import annotations

from curvopt.optim.stages.base import GroupStep, Stage
from curvopt.optim.transforms import ema


class AverageCurvature(Stage):
    order = 20
    identity_at = ("curvature_ema", 0)

    def __call__(self, step: GroupStep) -> None:
        decay = step.group["curvature_ema"]
        for item in step.params:
            if item.fresh is not None:
                item.curvature = ema(item.state.get("curvature"), item.fresh, decay)
