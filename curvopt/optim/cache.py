"""Caching of expensive derived quantities (inverses, eigendecompositions).

A cache entry is the plain dict ``{"value": ..., "key": ..., "step": int}`` so that it can live
in an optimizer's ``state`` and be saved with ``state_dict``.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Callable

CacheEntry = dict[str, Any]


def cached(
    entry: CacheEntry | None,
    key: Hashable,
    step: int,
    interval: int,
    compute: Callable[[], Any],
) -> CacheEntry:
    """The entry to use at ``step``: ``entry`` itself, or a new one holding ``compute()``.

    ``compute`` runs when there is no entry, or when the inputs changed (``key`` differs from
    ``entry["key"]``) and at least ``interval`` steps passed since ``entry["step"]``. So with
    ``interval = m`` an inverse is recomputed at most every ``m`` steps, and never while its
    inputs (e.g. curvature version, damping) stay the same. ``entry`` is not modified.
    """
    if entry is None or (entry["key"] != key and step - entry["step"] >= interval):
        return {"value": compute(), "key": key, "step": step}
    return entry
