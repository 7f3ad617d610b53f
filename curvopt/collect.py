"""``collect(*extensions)``: the context in which backward passes write quantities, and
``Collection``: the persistent, armed collection an optimizer owns (``optim.base``).

Several collections can be active at once: the open ``collect`` block and any number of armed
ones, each with its own passes, results and accumulation. The hooks dispatch to all of them
(``_Dispatch``); each writes only its own quantities. Where two would write the same
attribute on the same parameter, one does: the open block before the armed collections, a
newer armed collection before an older one; the one that stood aside notes it, and its
optimizer's next step raises if it would read values that mix its own passes with another's.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Callable, Dict, Optional, Tuple

from curvopt import unextended
from curvopt.accumulate import Accumulator
from curvopt.backward import BackwardPass
from curvopt.errors import AccumulationError, ExtensionConflictError
from curvopt.extensions.base import Extension
from curvopt.extensions.quantity import Combine, quantity
from curvopt.params import EXTENDED, owned
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
        self._task: Optional[int] = None  # the autograd task of ``_pass``
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
        if STATE.open is not None:
            raise RuntimeError(
                "curvopt.collect blocks cannot be nested; pass all extensions to one collect(...)"
            )
        STATE.open = self
        STATE.collecting = _DISPATCH
        self._accumulator = Accumulator()
        self._unextended = unextended.watch()
        return self

    def __exit__(self, *exc):
        STATE.open = None
        _refresh()
        self._pass = self._task = None
        self._unextended.remove()
        if exc[0] is None:
            self._warn_skipped()
        return False

    def _warn_skipped(self) -> None:
        if self.skipped:
            warnings.warn(
                "curvopt.collect(skip_unsupported=True) wrote no Kronecker factors for "
                f"{sorted(self.skipped)} (no Kronecker factorisation for them); "
                "optim.KFAC(..., fallback='diagonal') preconditions them by their diagonal",
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


class Collection(collect):
    """The persistent collection an optimizer owns. Armed, it collects what ``requests()``
    names on every backward pass that reaches the parameters it names, with no ``with`` block,
    and writes only for them; the passes of one window (until :meth:`reset`: the optimizer's
    ``step`` or ``zero_grad``, or a pass that finds every ``p.grad`` None: the model's
    ``zero_grad()``) combine like one batch (``accumulate``), as ``p.grad`` does. EKFAC's
    later passes of a window are computed in the bases its first pass made (the last
    refresh), so that ``S`` adds.

    ``requests() -> (extensions, [(param, attr)], collect options)``, read at the first pass
    of each window; ``None`` when its owner is gone.
    """

    def __init__(self, requests: Callable[[], Optional[tuple]]):
        super().__init__()
        self._requests = requests
        self._window: Optional[tuple] = None  # (extensions, {(id(p), attr)}, scope, options)
        #: what took over an attribute in a pass of this window: "block" (an open collect)
        #: or "optimizer" (a collection armed later on the same parameters); None
        self.stood_aside: Optional[str] = None
        self._ref: Optional[weakref.ref] = None
        self._params: list = []  # the parameters of the window's targets
        self._warned = False  # the window's skipped parameters were warned about
        #: ``(scope, the extended modules owning its parameters)``, kept while the scope stays
        self._owners: tuple = (set(), [])

    @property
    def armed(self) -> bool:
        return self._ref is not None

    def arm(self) -> None:
        if self._ref is None:
            self._ref = weakref.ref(self, _forget)
            STATE.armed.append(self._ref)
            _refresh()

    def disarm(self) -> None:
        if self._ref is not None:
            _forget(self._ref)
            self._ref = None

    @contextlib.contextmanager
    def paused(self):
        """Disarmed inside the block (re-armed in its place after): a backward pass that only
        measures a loss (Levenberg-Marquardt's second closure call) collects nothing."""
        index = STATE.armed.index(self._ref) if self._ref in STATE.armed else None
        if index is not None:
            STATE.armed.pop(index)
            _refresh()
        try:
            yield
        finally:
            if index is not None:
                STATE.armed.insert(min(index, len(STATE.armed)), self._ref)
                _refresh()

    def reset(self) -> None:
        """Start a new window: forget the passes so far (their values stay written)."""
        self._accumulator = Accumulator()
        self._window = self.stood_aside = None
        self._pass = self._task = None
        self._params = []
        self._warned = False
        self.skipped = {}

    def check(self, owner: str) -> None:
        """Raise where the values of this window are not this collection's alone (and warn
        about parameters left out, ``skip_unsupported``)."""
        self._warn_skipped()
        if self.stood_aside == "optimizer":
            raise ExtensionConflictError(
                f"{owner}: another curvopt optimizer created later on the same parameters "
                "collected the same quantities since this optimizer's last step, so this step "
                "would read that optimizer's values; give each parameter one curvopt optimizer "
                "(free the old one), or create them with collection='explicit'"
            )
        if self.stood_aside == "block" and self._accumulator.written:
            raise AccumulationError(
                f"{owner}: between two steps some backward passes ran inside a curvopt.collect "
                "block computing the quantities this optimizer needs and some outside it; the "
                "block's values do not include the other passes. Run all of them inside the "
                "block, or none (the optimizer collects on its own)"
            )

    def __enter__(self):
        """A block that adds nothing: an armed collection collects without one."""
        self.window()
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            self._warn_skipped()
        return False

    def _warn_skipped(self) -> None:
        """Once per window (at the end of ``opt.collect()``'s block, or at the step)."""
        if not self._warned:
            super()._warn_skipped()
            self._warned = bool(self.skipped)

    def window(self) -> tuple:
        """``(extensions, {(id(p), attr)}, scope, options)`` of this window."""
        if self._window is None:
            found = self._requests()
            exts, targets, options = found if found is not None else ([], [], {})
            wanted = {(id(p), attr) for p, attr in targets}
            self._params = list({id(p): p for p, _ in targets}.values())
            scope = {key for key, _ in wanted}
            if scope != self._owners[0]:
                self._owners = (scope, _owners(scope))
            self._window = (exts, wanted, scope, options)
            self.extensions = tuple(exts)
            self.skip_unsupported = options.get("skip_unsupported", False)
        return self._window

    def _taken(self, wanted: set) -> Tuple[set, Optional[str]]:
        """The attributes of ``wanted`` that a collection before this one writes this pass,
        and which kind of collection takes them ("optimizer" over "block")."""
        taken: set = set()
        kind = None
        block = STATE.open
        if block is not None:
            hit = {attr for _, attr in wanted} & {e.attr for e in block.extensions}
            if hit:
                taken, kind = hit, "block"
        newer = STATE.armed[STATE.armed.index(self._ref) + 1 :] if self._ref in STATE.armed else []
        for ref in newer:
            other = ref()
            hit = {key for key in wanted if other is not None and key in other.window()[1]}
            if hit:
                taken |= {attr for _, attr in hit}
                kind = "optimizer"
        return taken, kind

    def _new_pass(self, task: int):
        exts, wanted, scope, options = self.window()
        if not exts or not any(m._curvopt_live for m in self._owners[1]):
            return None  # nothing to collect, or no call of its modules awaits its gradient
        if self._accumulator.written and all(p.grad is None for p in self._params):
            self._accumulator = Accumulator()  # zero_grad() on the model: p.grad starts anew
        taken, kind = self._taken(wanted)
        if kind is not None and len(taken) == len(exts):
            return _StoodAside(self, kind, scope)
        if kind is not None:
            self.stood_aside = kind if self.stood_aside != "optimizer" else self.stood_aside
        exts = [self._in_earlier_bases(e) for e in exts if e.attr not in taken]
        skipped = self.skipped if self.skip_unsupported else None
        return BackwardPass(
            tuple(exts),
            task,
            self._accumulator,
            skipped,
            diagonal=self.skip_unsupported == "diagonal",
            scope=scope,
        )

    def _in_earlier_bases(self, ext: Extension) -> Extension:
        """``ext``, or for EKFAC one that takes the bases of this window's earlier passes."""
        if quantity(ext.attr).combine is not Combine.SAME_BASIS:
            return ext
        accumulator, attr, supplied = self._accumulator, ext.attr, ext.supplied

        def bases(p):
            earlier = accumulator.bases(p, attr)
            return supplied(p) if earlier is None else earlier

        return type(ext)(**{**ext.options, "bases": bases})


def _owners(scope: set) -> list:
    """The extended modules that own a parameter of ``scope`` (``id``s)."""
    return [m for m in list(EXTENDED) if any(id(p) in scope for _, p in owned(m))]


class _StoodAside:
    """The pass of a collection that left all its attributes to another one: it notes
    ``kind`` (``Collection.stood_aside``) once the pass reaches one of its parameters."""

    running = False  # no backward of its own to join (``collect.backward_pass``)

    def __init__(self, collection: Collection, kind: str, scope: set):
        self.collection, self.kind, self.scope = collection, kind, scope

    def on_loss(self, record, grad) -> bool:
        return False

    def on_module(self, record, grads) -> bool:
        return False

    def on_parameter_grad(self, param, grad) -> None:
        if id(param) in self.scope and self.collection.stood_aside != "optimizer":
            self.collection.stood_aside = self.kind


class _Passes:
    """The passes of several active collections for one backward pass, each hook sent to all."""

    def __init__(self, passes):
        self.passes = passes

    def on_loss(self, record, grad) -> bool:
        return any([p.on_loss(record, grad) for p in self.passes])

    def on_module(self, record, grads) -> bool:
        return any([p.on_module(record, grads) for p in self.passes])

    def on_parameter_grad(self, param, grad) -> None:
        for p in self.passes:
            p.on_parameter_grad(param, grad)


class _Dispatch:
    """What the hooks call (``STATE.collecting``) while a collection is open or armed: the
    passes of every active one (the open block first, then the armed ones, newest first)."""

    def backward_pass(self, outer: Optional[int] = None):
        active = [STATE.open] + [ref() for ref in reversed(STATE.armed)]
        passes = [c.backward_pass(outer) for c in active if c is not None]
        passes = [p for p in passes if p is not None]
        return passes[0] if len(passes) == 1 else _Passes(passes)


_DISPATCH = _Dispatch()


def _refresh() -> None:
    STATE.collecting = _DISPATCH if STATE.open is not None or STATE.armed else None


def _forget(ref) -> None:
    """Disarm the collection behind ``ref`` (also its weakref callback: its owner is gone)."""
    if ref in STATE.armed:
        STATE.armed.remove(ref)
    _refresh()
