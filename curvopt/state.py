"""Process-wide state shared by the forward hooks and the backward pass."""

from __future__ import annotations

import contextlib


class _State:
    def __init__(self):
        self.collecting = None  # the active curvopt.collect context, if any
        self.suspended = 0  # >0 while curvopt itself re-runs modules or propagates curvature

    @contextlib.contextmanager
    def suspend(self):
        """Forward and gradient hooks do nothing inside this block."""
        self.suspended += 1
        try:
            yield
        finally:
            self.suspended -= 1


STATE = _State()
