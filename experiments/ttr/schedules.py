"""Learning-rate schedules of the time-to-result grids, as a factor on the base lr.

``warmup_cosine`` (AlgoPerf's baselines): linear warm-up from 0 over the first
``WARMUP_FRACTION`` of the step cap ``T``, then cosine decay to 0 at ``T``:
``f(t) = (t + 1) / w`` for ``t < w``, else ``(1 + cos(π (t - w) / (T - w))) / 2``.
"""

from __future__ import annotations

import math

SCHEDULES = ("constant", "warmup_cosine")
WARMUP_FRACTION = 0.05


def lr_factor(schedule: str, step: int, max_steps: int) -> float:
    """The factor of step ``step`` (0-based) of a run capped at ``max_steps`` steps."""
    if schedule == "constant":
        return 1.0
    if schedule != "warmup_cosine":
        raise ValueError(f"unknown schedule {schedule!r}; choose from {SCHEDULES}")
    warmup = max(1, round(WARMUP_FRACTION * max_steps))
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * progress))
