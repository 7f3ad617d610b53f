"""Learning-rate schedules of the time-to-result grids, as a factor on the base lr.

Both warm up linearly from 0 over the first ``WARMUP_FRACTION`` of the step cap ``T``
(``w = round(0.05 T)`` steps): ``f(t) = (t + 1) / w`` for ``t < w``. Then ``warmup_cosine``
(AlgoPerf's baselines) decays by a cosine to 0 at ``T``,
``f(t) = (1 + cos(π (t - w) / (T - w))) / 2``, and ``warmup`` (schedule-free AdamW's, whose
averaging replaces the decay) stays at 1.
"""

from __future__ import annotations

import math

SCHEDULES = ("constant", "warmup_cosine", "warmup")
WARMUP_FRACTION = 0.05


def lr_factor(schedule: str, step: int, max_steps: int) -> float:
    """The factor of step ``step`` (0-based) of a run capped at ``max_steps`` steps."""
    if schedule == "constant":
        return 1.0
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose from {SCHEDULES}")
    warmup = max(1, round(WARMUP_FRACTION * max_steps))
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "warmup":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * progress))
