"""The planned step of one parameter (:class:`ParamUpdate`) and the cache entries its state
keeps (:func:`cached`): the data a step is planned in, shared by the optimizer base
(``optim.base``, which checks a whole plan and applies it), the stages and the optimizers.

When a curvature is refreshed: :func:`refresh_interval` (``curvature_interval``'s default).

A cache entry (:func:`cached`: inverses, eigendecompositions) is the plain dict
``{"value": ..., "key": ..., "step": int}`` so that it can live in an optimizer's ``state``
and be saved with ``state_dict``.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

#: ``k`` when none is given under the default relative damping (:func:`refresh_interval`): the
#: curvature (and its inverses) refreshed every ``k`` steps, the steps in between plain ones
#: that leave the engine alone (``frontend.collection``); the first step always refreshes
DEFAULT_CURVATURE_INTERVAL = 10


def refresh_interval(curvature_interval: int | None, damping) -> int:
    """A group's curvature interval: ``curvature_interval`` as given, or for ``None`` (the
    default) :data:`DEFAULT_CURVATURE_INTERVAL` under the default relative damping
    (``damping=None``) and 1 (every step, the paper's update) with a damping given."""
    if curvature_interval is not None:
        return curvature_interval
    return DEFAULT_CURVATURE_INTERVAL if damping is None else 1


@dataclass
class ParamUpdate:
    """The planned change of one parameter: ``θ ← θ − delta`` and its new ``state``."""

    param: torch.Tensor
    description: str
    delta: torch.Tensor | None = None
    state: dict[str, Any] = field(default_factory=dict)
    #: ``(what, tensor)`` pairs that must be finite for the step to be taken
    checks: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    #: the quantity objects read from the parameter (to detect stale ones next time)
    consumed: dict[str, Any] = field(default_factory=dict)


CacheEntry = dict[str, Any]


def cached(
    entry: CacheEntry | None,
    key: Hashable,
    step: int,
    interval: int,
    compute: Callable[[], Any],
) -> CacheEntry:
    """The cache entry to use at ``step``: ``entry`` itself, or a new one holding ``compute()``.

    ``compute`` runs when there is no entry, or when the inputs changed (``key`` differs from
    ``entry["key"]``) and at least ``interval`` steps passed since ``entry["step"]``. So with
    ``interval = m`` an inverse is recomputed at most every ``m`` steps, and never while its
    inputs (e.g. curvature version, damping) stay the same. ``entry`` is not modified.

    Args:
        entry: the previous entry ``{"value", "key", "step"}``, or ``None``.
        key: what the value depends on (compared with ``!=``).
        step: the current step count.
        interval: the least number of steps between two computations.
        compute: a callable returning the new value.

    Returns:
        The entry (a dict with ``"value"``, ``"key"`` and ``"step"``).

    Example:
        >>> from curvopt.optim import cached
        >>> entry = cached(None, key="a", step=0, interval=2, compute=lambda: 1)
        >>> cached(entry, key="b", step=1, interval=2, compute=lambda: 2)["value"]  # too early
        1
        >>> cached(entry, key="b", step=2, interval=2, compute=lambda: 2)["value"]
        2
    """
    if entry is None or (entry["key"] != key and step - entry["step"] >= interval):
        return {"value": compute(), "key": key, "step": step}
    return entry
