"""Base class of the quantities ``collect`` computes."""

from __future__ import annotations

from typing import Any, Dict, Tuple


class Extension:
    """A quantity written as ``p.<attr>`` on every parameter that requires grad.

    ``order`` is 1 for quantities built from per-sample gradients and 2 for curvature, which
    needs the loss to be an extended loss module. ``options`` are the constructor arguments;
    two extensions writing the same attribute must agree on them.
    """

    attr: str = ""
    order: int = 1

    def __init__(self, **options: Any):
        self.options: Dict[str, Any] = options

    def key(self) -> Tuple[Any, ...]:
        return (type(self).__name__, tuple(sorted(self.options.items())))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"{type(self).__name__}({args})"
