"""``Collection``: the persistent collection an optimizer owns (``optim.base``), armed from
the optimizer's construction: it collects on every backward pass that reaches its parameters,
with no ``with`` block, and combines the passes of one window (until the optimizer's step or
``zero_grad``) like one batch. ``collect``'s router sends each backward pass's hooks to it
(and to the open ``collect`` block and the other armed collections; see ``collect`` for which
one writes an attribute two of them want).

A window whose step refreshes no curvature (``curvature_interval``) is a plain one: the
collection rests (:meth:`Collection.follow`, asked at the start of each window whether its
owner's next step collects), stays armed but takes no pass, and the models it covers
(:meth:`Collection.covers`) carry no hook while no awake collection covers them and no block
is open (``resting``).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Callable, Optional, Tuple

from curvopt.engine.accumulate import Accumulator
from curvopt.loop.backward import BackwardPass
from curvopt.frontend.collect import alive, collect, forget, refresh
from curvopt.errors import AccumulationError, ExtensionConflictError
from curvopt.extensions.base import Extension
from curvopt.extensions.quantity import Combine, quantity
from curvopt.core.extended import live_calls, models_of
from curvopt.core.params import holders
from curvopt.core.state import STATE


class Collection(collect):
    """The persistent collection an optimizer owns. Armed, it collects what ``requests()``
    names on every backward pass that reaches the parameters it names, with no ``with`` block,
    and writes only for them; the passes of one window (until :meth:`reset`: the optimizer's
    ``step`` or ``zero_grad``, or a pass that finds every ``p.grad`` None: the model's
    ``zero_grad()``) combine like one batch (``accumulate``), as ``p.grad`` does. EKFAC's
    later passes of a window are computed in the bases its first pass made (the last
    refresh), so that ``S`` adds.

    ``requests() -> (extensions, [(param, attr)], collect options)``, read at the first pass
    of each window; ``None`` when its owner is gone. ``passes`` counts the window's backward
    passes that collected. ``collects() -> bool``: whether the owner's next step collects
    anything, asked when a window starts (:meth:`follow`); where not, the collection rests
    through the window (default: it never rests). ``terms``: how its passes' errors are phrased
    for the owner (``collect.terms``).
    """

    #: armed, but taking no pass in this window: its owner's next step collects nothing
    resting = False

    def __init__(
        self,
        requests: Callable[[], Optional[tuple]],
        collects: Optional[Callable[[], bool]] = None,
        terms=None,
    ):
        super().__init__()
        self.terms = terms
        self._requests = requests
        self._collects = collects
        self._window: Optional[tuple] = None  # (extensions, {(id(p), attr)}, scope, options)
        #: what took over an attribute in a pass of this window: "block" (an open collect)
        #: or "optimizer" (a collection armed later on the same parameters); None
        self.stood_aside: Optional[str] = None
        self._ref: Optional[weakref.ref] = None
        self._watched: Optional[weakref.ref] = None  # in ``STATE.explicit`` (:meth:`watch`)
        self._params: list = []  # the parameters of the window's targets
        self._warned = False  # the window's skipped parameters were warned about
        #: ``(scope, the extended modules owning its parameters)``, kept while the scope stays
        self._owners: tuple = (set(), [])
        #: ``(scope, weak references to the models holding its parameters)`` of its last
        #: window that named parameters (their hooks rest while it does: ``resting``); None
        #: before any, and after its owner's parameters may have changed (:meth:`follow`)
        self._covered: Optional[tuple] = None
        self._moved = False  # ``_covered`` changed in a pass since the hooks were settled
        self.passes = 0  # the backward passes of this window that collected

    @property
    def armed(self) -> bool:
        return self._ref is not None

    def arm(self) -> None:
        if self._ref is None:
            self.resting = not self._wanted()
            self._ref = weakref.ref(self, forget)
            STATE.armed = (*alive(), self._ref)
            refresh()

    def watch(self) -> None:
        """Not armed (an explicit optimizer's, which collects in its own blocks), but seen by
        the hooks: while its owner's next step collects they record every forward, for the
        block around the backward that follows (``STATE.explicit``)."""
        if self._watched is None:
            self.resting = not self._wanted()
            self._watched = weakref.ref(self, _unwatch)
            STATE.explicit = (*(r for r in STATE.explicit if r() is not None), self._watched)
            refresh()

    def follow(self) -> None:
        """Rest through this window, or wake, as the owner's next step needs (``collects``),
        where its owner's parameters may have changed (``add_param_group``, a loaded state):
        until its next pass names them, it covers every model (:meth:`covers`), so that the
        models of parameters added, resting under another optimizer, record the forward."""
        self._moved = self._moved or self._covered is not None
        self._covered = None
        self._follow()

    def _follow(self) -> None:
        """Rest through this window, or wake (at the start of each window); the hooks settled
        anew also where the last window's pass changed the models it covers (found during a
        backward, where no hook dict is changed)."""
        resting = not self._wanted()
        if resting != self.resting or self._moved:
            self.resting = resting
            self._moved = False
            refresh()

    def covers(self) -> Optional[set]:
        """The ids of the models whose hooks it needs while awake, and lets rest while it
        rests: those holding the parameters of its last window that named any; None (every
        model) before such a window, or after :meth:`follow`."""
        if self._covered is None:
            return None
        return {id(m) for m in (ref() for ref in self._covered[1]) if m is not None}

    def _wanted(self) -> bool:
        return self._collects is None or bool(self._collects())

    def backward_pass(self, outer: Optional[int] = None):
        """As ``collect.backward_pass``; None while resting (the pass is not this one's)."""
        return None if self.resting else super().backward_pass(outer)

    def disarm(self) -> None:
        if self._ref is not None:
            forget(self._ref)
            self._ref = None

    @contextlib.contextmanager
    def paused(self):
        """Disarmed inside the block (re-armed in its place after): a backward pass that only
        measures a loss (Levenberg-Marquardt's second closure call) collects nothing."""
        armed = STATE.armed
        index = next((i for i, ref in enumerate(armed) if ref is self._ref), None)
        if index is not None:
            STATE.armed = armed[:index] + armed[index + 1 :]
            refresh()
        try:
            yield
        finally:
            if index is not None:
                armed = STATE.armed
                STATE.armed = armed[:index] + (self._ref,) + armed[index:]
                refresh()

    def reset(self) -> None:
        """Start a new window: forget the passes so far (their values stay written), and rest
        through it or not (:meth:`follow`)."""
        self._accumulator = Accumulator()
        self._window = self.stood_aside = None
        self._pass = self._task = None
        self.passes = 0
        self._params = []
        self._warned = False
        self.skipped = {}
        self._follow()

    def check(self, owner: str) -> None:
        """Raise where the values of this window are not this collection's alone (and warn
        about parameters left out, ``skip_unsupported``)."""
        self._warn_skipped()
        if self.stood_aside == "optimizer":
            raise ExtensionConflictError(
                f"{owner}: another curvopt optimizer created later on the same parameters "
                "collected the same quantities since this optimizer's last step. Give each "
                "parameter one curvopt optimizer (free the old one), or create them with "
                "collection='explicit'; see docs/support.md#several-backward-passes."
            )
        if self.stood_aside == "block" and self._accumulator.written:
            raise AccumulationError(
                f"{owner}: between two steps some backward passes ran inside a curvopt.collect "
                "block computing this optimizer's quantities and some outside it. Run all of "
                "them inside the block, or none (the optimizer collects on its own); see "
                "docs/support.md#several-backward-passes."
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
                self._owners = (scope, holders(self._params))
            if scope and (self._covered is None or self._covered[0] is not self._owners[0]):
                self._cover()
            self._window = (exts, wanted, scope, options)
            self.extensions = tuple(exts)
            self.skip_unsupported = options.get("skip_unsupported", False)
        return self._window

    def _cover(self) -> None:
        """Note the models holding this window's parameters (``_owners``)."""
        models = {id(m): m for h in self._owners[1] for m in models_of(h)}
        self._moved = self._moved or self._covered is None or models.keys() != self.covers()
        self._covered = (self._owners[0], [weakref.ref(m) for m in models.values()])

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
        if not exts or not any(live_calls(m) for m in self._owners[1]):
            return None  # nothing to collect, or no call of its modules awaits its gradient
        if self._accumulator.written and all(p.grad is None for p in self._params):
            self._accumulator = Accumulator()  # zero_grad() on the model: p.grad starts anew
            self.passes = 0
        taken, kind = self._taken(wanted)
        if kind is not None and len(taken) == len(exts):
            return _StoodAside(self, kind, scope)
        if kind is not None:
            self.stood_aside = kind if self.stood_aside != "optimizer" else self.stood_aside
        exts = [self._in_earlier_bases(e) for e in exts if e.attr not in taken]
        skipped = self.skipped if self.skip_unsupported else None
        self.passes += 1
        return BackwardPass(
            tuple(exts),
            task,
            self._accumulator,
            skipped,
            diagonal=self.skip_unsupported == "diagonal",
            scope=scope,
            terms=self.terms,
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


def _unwatch(ref) -> None:
    """The weakref callback of an explicit optimizer's collection: its owner is gone."""
    STATE.explicit = tuple(r for r in STATE.explicit if r is not ref and r() is not None)
    refresh()


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
