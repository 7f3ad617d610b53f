"""``collect(*extensions)``: the context in which backward passes write quantities, and the
pass each collection makes of a backward pass while its block is open or it is armed
(``collection``); the hooks reach these passes through ``routing``.

Several collections can be active at once: the open ``collect`` block and any number of armed
ones, each with its own passes, results and accumulation. The hooks are routed to all of them
(``routing.ROUTER``); each writes only its own quantities. Where two would write the same
attribute on the same parameter, one does: the open block before the armed collections, a
newer armed collection before an older one; the one that stood aside notes it, and its
optimizer's next step raises if it would read values that mix its own passes with another's.
"""

from __future__ import annotations

import warnings
from typing import Callable, Dict, Optional, Tuple

from curvopt.guards import unextended
from curvopt.engine.accumulate import Accumulator
from curvopt.loop.backward import BackwardPass
from curvopt.loop.routing import ROUTER
from curvopt.errors import ExtensionConflictError
from curvopt.extensions.base import Extension
from curvopt.core.state import STATE
from curvopt.frontend.resting import settle
from curvopt.autograd.torch_internals import current_graph_task_id


class collect:  # noqa: N801  (used like a function: ``with curvopt.collect(...):``)
    """Compute ``extensions`` during every ``backward()`` run inside this block.

    Extensions that share work (per-sample gradients, propagated curvature factors, Monte-Carlo
    samples) compute it once. Results are written as attributes when a backward pass has
    finished; a pass that raises writes nothing. Several backward passes in one block
    (micro-batches) combine like ``p.grad`` does (see ``accumulate``). A parameter of the
    models the pass goes through that it does not reach (an unused head, a skipped branch)
    holds no earlier value afterwards: zeros, of the pass's ``N`` rows per sample, and no
    Kronecker factors (docs/conventions.md, "Never a stale value").

    ``skip_unsupported=True`` opts in to leaving out the parameters that have no Kronecker
    factorisation (a ViT's class token and position embeddings, raw 3-D parameters, recurrent
    weights): they get no ``kfac``/``kflr`` attribute, their names are listed in
    ``self.skipped`` (name -> the one-sentence cause, shared by the parameters it holds for)
    and a warning names each cause once, with its parameters. ``skip_unsupported="diagonal"``
    writes for them the diagonal of the same curvature instead, ``p.kfac_diagonal`` /
    ``p.kflr_diagonal`` / ``p.ekfac_diagonal`` (``p.shape``, from the same propagated columns:
    the Monte-Carlo GGN diagonal for ``KFAC``, the exact one for ``KFLR``, that of the columns
    ``EKFAC``'s bases come from). Without the opt-in such a parameter
    raises, naming it and this option.

    Args:
        *extensions: instances of :mod:`curvopt.extensions` (``BatchGrad()``, ``KFAC()``, ...),
            at most one per attribute.
        skip_unsupported: ``False`` (raise), ``True`` (leave such parameters out) or
            ``"diagonal"`` (their diagonal instead of factors).

    Returns:
        The context manager; ``skipped`` lists the parameters left out (name -> cause).

    Raises:
        ExtensionConflictError: two extensions write one attribute with different settings.

    Example::

        loss = lossfunc(model(X), y)
        with curvopt.collect(ext.BatchGrad(), ext.KFAC()):
            loss.backward()
        model[0].weight.grad_batch, model[0].weight.kfac  # [N, *shape], [B, A]
    """

    #: how the errors of its passes are phrased for whom opened it: an optimizer names its
    #: own arguments (``optim.base``, ``errors.in_optimizer_terms``); None: as raised
    terms: Optional[Callable[[BaseException], BaseException]] = None

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
        self._task: Optional[int] = None  # the autograd task of ``_pass``
        self._nested: set = set()  # autograd tasks run inside the current pass (see backward_pass)
        self._accumulator = Accumulator()
        if skip_unsupported not in (False, True, "diagonal"):
            raise ValueError(
                f"skip_unsupported must be False, True or 'diagonal', got {skip_unsupported!r}"
            )
        self.skip_unsupported = skip_unsupported
        #: parameters left out under ``skip_unsupported``: name -> why (the short cause, the same
        #: string for every parameter with that cause)
        self.skipped: Dict[str, str] = {}

    def __enter__(self):
        if STATE.open is not None:
            raise RuntimeError(
                "curvopt.collect blocks cannot be nested; pass all extensions to one collect(...)"
            )
        STATE.open = self
        refresh()
        self._accumulator = Accumulator()
        self._unextended = unextended.watch()
        return self

    def __exit__(self, *exc):
        STATE.open = None
        refresh()
        self._pass = self._task = None
        self._unextended.remove()
        if exc[0] is None:
            self._warn_skipped()
        return False

    @property
    def reduction_scale(self) -> float:
        """``s`` of the curvature this block's passes wrote: ``Σ w N / D`` over their extended
        losses (``LossRule.reduction_scale``; ``w`` the factor a loss enters the backward
        with), the scale of one sample's curvature in theirs; 0 before any."""
        return self._accumulator.reduction_scale

    def _warn_skipped(self) -> None:
        """One warning naming each cause once, with the parameters it left out."""
        if self.skipped:
            warnings.warn(
                "curvopt.collect(skip_unsupported=True) wrote no Kronecker factors for "
                f"{skipped_by_cause(self.skipped)}. optim.KFAC(..., fallback='diagonal') "
                "preconditions them by their diagonal; see docs/support.md#no-kronecker-factors.",
                stacklevel=3,
            )

    def _new_pass(self, task: int) -> Optional[BackwardPass]:
        skipped = self.skipped if self.skip_unsupported else None
        return BackwardPass(
            self.extensions,
            task,
            self._accumulator,
            skipped,
            diagonal=self.skip_unsupported == "diagonal",
            terms=self.terms,
        )

    def ran(self, task: int) -> bool:
        """Whether an extended module or loss took part in the backward pass ``task``."""
        return self._pass is not None and (self._task == task or task in self._nested)

    def backward_pass(self, outer: Optional[int] = None) -> Optional[BackwardPass]:
        """The state of the backward pass now running, created at its first hook.

        A backward run from inside another (``torch.utils.checkpoint(use_reentrant=True)``
        backpropagates its recomputed segment in a nested autograd task, a checkpoint inside
        that segment in a task nested in that one) belongs to the outer pass: ``outer`` is the
        task that ran the forward of the call asking, which is the outer pass or one nested in
        it while the outer pass runs."""
        task = current_graph_task_id()
        current = self._pass
        if self._task is not None and task != self._task:
            if outer is not None and current is not None and current.running:
                self._nested.add(task)
            if task in self._nested:
                return current
        if self._task != task:
            self._task = task
            self._pass = self._new_pass(task)
            self._nested = set()
        return self._pass


def skipped_by_cause(skipped: Dict[str, str]) -> str:
    """``skipped`` (parameter name -> cause) as ``'a', 'b' (cause); 'c' (other cause)``: each
    cause once, after its parameters, in the order of their names."""
    names: Dict[str, list] = {}
    for name in sorted(skipped):
        names.setdefault(skipped[name], []).append(name)
    return "; ".join(
        f"{', '.join(repr(n) for n in group)} ({cause})" for cause, group in names.items()
    )


def refresh() -> None:
    """``STATE.collecting``: the router while a block is open or an armed collection is
    awake (not resting, ``Collection.follow``); ``STATE.plain`` while collections are armed,
    all resting, no explicit one waits for a step that collects, and no block is open; then
    the hooks that have nothing to do taken off, those that may act put back (``resting``)."""
    if not STATE.armed and not STATE.explicit:  # (a collect block alone: nothing to ask)
        STATE.collecting = ROUTER if STATE.open is not None else None
        STATE.plain = False
    else:
        armed = [c for c in (ref() for ref in STATE.armed) if c is not None]
        awake = any(not c.resting for c in armed)
        waiting = any(c is not None and not c.resting for c in (ref() for ref in STATE.explicit))
        STATE.collecting = ROUTER if STATE.open is not None or awake else None
        STATE.plain = STATE.open is None and bool(armed) and not awake and not waiting
    settle()


def alive() -> tuple:
    """``STATE.armed`` without the references whose collection is gone (their callback, run
    by the garbage collector during another change of ``STATE.armed``, may have come too
    early to remove them)."""
    return tuple(ref for ref in STATE.armed if ref() is not None)


def forget(ref) -> None:
    """Disarm the collection behind ``ref`` (also its weakref callback: its owner is gone).
    ``STATE.armed`` is replaced, not changed in place (see ``core.state``)."""
    STATE.armed = tuple(r for r in alive() if r is not ref)
    refresh()
