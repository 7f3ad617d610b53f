"""``collect(*extensions)``: the context in which backward passes write quantities."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from curvopt.accumulate import Accumulator
from curvopt.backward import BackwardPass
from curvopt.errors import ExtensionConflictError
from curvopt.extensions.base import Extension
from curvopt.state import STATE


class collect:  # noqa: N801  (used like a function: ``with curvopt.collect(...):``)
    """Compute ``extensions`` during every ``backward()`` run inside this block.

    Extensions that share work (per-sample gradients, propagated curvature factors, Monte-Carlo
    samples) compute it once. Results are written as attributes when a backward pass has
    finished; a pass that raises writes nothing. Several backward passes in one block
    (micro-batches) combine like ``p.grad`` does (see ``accumulate``).
    """

    def __init__(self, *extensions: Extension):
        by_attr: Dict[str, Extension] = {}
        for ext in extensions:
            if not isinstance(ext, Extension):
                raise TypeError(
                    f"curvopt.collect expects extension instances such as "
                    f"curvopt.extensions.BatchGrad(), got {ext!r}"
                )
            other = by_attr.get(ext.attr)
            if other is not None and other.key() != ext.key():
                raise ExtensionConflictError(
                    f"{other!r} and {ext!r} both write p.{ext.attr} with different settings; "
                    "pass only one of them"
                )
            by_attr[ext.attr] = ext
        self.extensions: Tuple[Extension, ...] = tuple(by_attr.values())
        self._pass: Optional[BackwardPass] = None
        self._nested: set = set()  # autograd tasks run inside the current pass (see backward_pass)
        self._accumulator = Accumulator()

    def __enter__(self):
        if STATE.collecting is not None:
            raise RuntimeError(
                "curvopt.collect blocks cannot be nested; pass all extensions to one collect(...)"
            )
        STATE.collecting = self
        self._accumulator = Accumulator()
        return self

    def __exit__(self, *exc):
        STATE.collecting = None
        self._pass = None
        return False

    def backward_pass(self, outer: Optional[int] = None) -> BackwardPass:
        """The state of the backward pass now running, created at its first hook.

        A backward run from inside another (``torch.utils.checkpoint(use_reentrant=True)``
        backpropagates its recomputed segment in a nested autograd task) belongs to the
        outer pass: ``outer`` is the task that ran the forward of the call asking."""
        task = torch._C._current_graph_task_id()
        current = self._pass
        if current is not None and task != current.task:
            if outer is not None and outer == current.task:
                self._nested.add(task)
            if task in self._nested:
                return current
        if current is None or current.task != task:
            self._pass = BackwardPass(self.extensions, task, self._accumulator)
            self._nested = set()
        return self._pass
