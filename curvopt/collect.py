"""``collect(*extensions)``: the context in which backward passes write quantities."""

from __future__ import annotations

import warnings
from typing import Dict, Optional, Tuple

from curvopt import unextended
from curvopt.accumulate import Accumulator
from curvopt.backward import BackwardPass
from curvopt.errors import ExtensionConflictError
from curvopt.extensions.base import Extension
from curvopt.state import STATE
from curvopt.torch_internals import current_graph_task_id


class collect:  # noqa: N801  (used like a function: ``with curvopt.collect(...):``)
    """Compute ``extensions`` during every ``backward()`` run inside this block.

    Extensions that share work (per-sample gradients, propagated curvature factors, Monte-Carlo
    samples) compute it once. Results are written as attributes when a backward pass has
    finished; a pass that raises writes nothing. Several backward passes in one block
    (micro-batches) combine like ``p.grad`` does (see ``accumulate``).

    ``skip_unsupported=True`` opts in to leaving out the parameters that have no Kronecker
    factorisation (a ViT's class token and position embeddings, raw 3-D parameters, recurrent
    weights): they get no ``kfac``/``kflr`` attribute, their names are listed in
    ``self.skipped`` (name -> reason) and a warning names them. ``skip_unsupported="diagonal"``
    writes for them the diagonal of the same curvature instead, ``p.kfac_diagonal`` /
    ``p.kflr_diagonal`` (``p.shape``, from the same propagated columns: the Monte-Carlo GGN
    diagonal for ``KFAC``, the exact one for ``KFLR``). Without the opt-in such a parameter
    raises, naming it and this option.
    """

    def __init__(self, *extensions: Extension, skip_unsupported=False):
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
        if skip_unsupported not in (False, True, "diagonal"):
            raise ValueError(
                f"skip_unsupported must be False, True or 'diagonal', got {skip_unsupported!r}"
            )
        self.skip_unsupported = skip_unsupported
        #: parameters left out under ``skip_unsupported``: name -> why
        self.skipped: Dict[str, str] = {}

    def __enter__(self):
        if STATE.collecting is not None:
            raise RuntimeError(
                "curvopt.collect blocks cannot be nested; pass all extensions to one collect(...)"
            )
        STATE.collecting = self
        self._accumulator = Accumulator()
        self._unextended = unextended.watch()
        return self

    def __exit__(self, *exc):
        STATE.collecting = None
        self._pass = None
        self._unextended.remove()
        if self.skipped and exc[0] is None:
            warnings.warn(
                "curvopt.collect(skip_unsupported=True) wrote no Kronecker factors for "
                f"{sorted(self.skipped)} (no Kronecker factorisation for them); "
                "optim.KFAC(..., fallback='diagonal') preconditions them by their diagonal",
                stacklevel=2,
            )
        return False

    def ran(self, task: int) -> bool:
        """Whether an extended module or loss took part in the backward pass ``task``."""
        current = self._pass
        return current is not None and (current.task == task or task in self._nested)

    def backward_pass(self, outer: Optional[int] = None) -> BackwardPass:
        """The state of the backward pass now running, created at its first hook.

        A backward run from inside another (``torch.utils.checkpoint(use_reentrant=True)``
        backpropagates its recomputed segment in a nested autograd task, a checkpoint inside
        that segment in a task nested in that one) belongs to the outer pass: ``outer`` is the
        task that ran the forward of the call asking, which is the outer pass or one nested in
        it while the outer pass runs."""
        task = current_graph_task_id()
        current = self._pass
        if current is not None and task != current.task:
            if outer is not None and current.running:
                self._nested.add(task)
            if task in self._nested:
                return current
        if current is None or current.task != task:
            skipped = self.skipped if self.skip_unsupported else None
            self._pass = BackwardPass(
                self.extensions,
                task,
                self._accumulator,
                skipped,
                diagonal=self.skip_unsupported == "diagonal",
            )
            self._nested = set()
        return self._pass
