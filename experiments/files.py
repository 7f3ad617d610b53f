"""Writing result files: JSON-safe numbers and atomic replacement."""

from __future__ import annotations

import math
import os
from pathlib import Path


def finite(x):
    """JSON-safe: non-finite floats become None."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [finite(v) for v in x]
    return x


def atomic_write(path: Path, write) -> None:
    """Call ``write(tmp)`` on a temporary sibling of ``path``, then move it into place."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)
