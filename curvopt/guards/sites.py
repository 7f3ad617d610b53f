"""The raw parameters read at their sites (``engine.parameter_sites.SiteReadings``): every
one claimed that received a gradient was read, and the tolerance a site's reading must meet
against its module's rule on a structure's first pass.

The guard observes only: the reading, and the result it feeds, are the engine's.
"""

from __future__ import annotations

from curvopt.engine.results import name_of
from curvopt.errors import UnsupportedModuleError
from curvopt.guards.observer import Ending, PassGuard
from curvopt.guards.tolerance import mismatch


def site_agrees(reading, rule_reading) -> bool:
    """Whether a site's per-sample gradients ``[N, *p.shape]`` match its module rule's, to the
    sum checks' cheap bound (``tolerance.mismatch``, factor 64)."""
    return not mismatch(reading, rule_reading, 64)


class SitesRead(PassGuard):
    """At the end of a pass: each parameter ``readings`` claimed (``SiteReadings.pending``)
    that received a gradient (``checks``) was read at its site."""

    def __init__(self, readings, checks):
        self.readings, self.checks = readings, checks

    def finish(self, ending: Ending) -> None:
        for p in self.readings.pending.values():
            if self.checks.has_grad(p):
                raise UnsupportedModuleError(
                    f"curvopt: parameter {name_of(p)!r} received a gradient, but the add or "
                    "expand where its per-sample gradients were to be read never ran in this "
                    "pass. Report the model as a curvopt bug."
                )
