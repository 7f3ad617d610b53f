"""``RunConfig``: everything that determines a run's numbers, and the run's file name."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

from .data import VALID_SIZE
from .optimizers import DAMPED, OPTIMIZERS, check_options
from .problems import get_problem


@dataclass(frozen=True)
class RunConfig:
    """Everything that determines a run's numbers (the device does not enter its name).

    ``preset`` and ``options`` (sorted ``(key, value)`` pairs) set the optimizer's keyword
    options, see :mod:`experiments.optimizers`.
    """

    problem: str
    optimizer: str
    lr: float
    damping: float | None = None
    seed: int = 0
    epochs: int | None = None
    batch_size: int | None = None
    train_size: int | None = None
    eval_size: int | None = None
    valid_size: int = VALID_SIZE
    augment: bool | None = None
    synthetic: bool = False
    preset: str | None = None
    options: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self):
        problem = get_problem(self.problem)
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"unknown optimizer {self.optimizer!r}; choose from {', '.join(OPTIMIZERS)}"
            )
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if self.optimizer in DAMPED and (self.damping is None or self.damping < 0):
            raise ValueError(f"{self.optimizer} needs a damping >= 0 (--damping)")
        if self.optimizer not in DAMPED and self.damping is not None:
            raise ValueError(f"{self.optimizer} takes no damping")
        object.__setattr__(self, "options", tuple(sorted(dict(self.options).items())))
        if self.preset is not None or self.options:
            check_options(self.optimizer, self.preset, self.options)
        # Fill in the problem's defaults so that equal runs get equal names.
        defaults = {
            "epochs": problem.epochs,
            "batch_size": problem.batch_size,
            "augment": problem.augment,
        }
        for key, value in defaults.items():
            if getattr(self, key) is None:
                object.__setattr__(self, key, value)
        if self.epochs < 1 or self.batch_size < 1:
            raise ValueError("epochs and batch_size must be >= 1")
        if self.train_size is not None and self.train_size < self.batch_size:
            raise ValueError(
                f"train_size {self.train_size} is smaller than one batch ({self.batch_size})"
            )

    @property
    def name(self) -> str:
        """Readable, deterministic file name stem: key settings plus a hash of all of them.

        A run without preset and options hashes as before they existed (same names)."""
        fields = asdict(self)
        if self.preset is None and not self.options:
            del fields["preset"], fields["options"]
        digest = hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:8]
        damping = "" if self.damping is None else f"_damp{self.damping:g}"
        preset = "" if self.preset is None else f"_{self.preset}"
        tag = "_synthetic" if self.synthetic else ""
        return (
            f"{self.problem}_{self.optimizer}{preset}_lr{self.lr:g}{damping}_seed{self.seed}_"
            f"{digest}{tag}"
        )
