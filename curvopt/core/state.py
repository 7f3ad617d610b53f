"""The collections' arming, read by the hooks and the backward pass, and the suspend switch.

``collecting`` is what the hooks route a backward pass to (``collect``'s router), set
only while a ``collect`` block is open or a collection is armed, so that without either an
extended model costs what the plain model costs. ``open`` is the open ``collect`` block;
``armed`` holds weak references to the persistent collections that optimizers own (oldest
first), so an optimizer that is freed disarms its collection; one whose optimizer refreshes no
curvature in the current window (a plain step) stays there, resting. It is a tuple, replaced
and never changed in place: the weak references' callbacks run whenever the garbage collector
frees a collection, also in the middle of a loop over ``armed``, which must not lose its place.

``explicit`` holds weak references to the collections of optimizers that collect only in
their own blocks (``collection="explicit"``, ``torch.distributed``): they take no pass, but
one whose next step collects needs the records of the forward that comes before its block.
``plain`` is true while collections are armed, all of them rest, no explicit one waits for a
step that collects and no block is open: the optimizers said that the passes until their next
step compute nothing. ``taken`` is true while the hooks of some extended modules are taken off
(``frontend.resting``: those of the models whose armed collections all rest; the extended
losses' while ``plain`` holds): forward and backward of a resting model cost what the plain
model's cost.

These are the collections' arming (and, ``taken``, what ``resting`` made of it), which the
user's thread sets (``collect``, an optimizer) and the hooks read, also a backward hook that
autograd runs in a worker thread of its own (a CUDA device's): a context variable set in the
user's thread would not reach it, so they stay here, set only by the collections
(``frontend``), never by a pass or a layer rule.

The suspend switch is not: it is a context variable, :data:`SUSPENDED` (read by the hooks as
``SUSPENDED.get()``), true inside :meth:`_State.suspend`, which curvopt enters where it re-runs
a module or differentiates through one itself (a pass's ``Call.quiet``, the curvature
propagation, ``linalg``'s products). It holds in the thread (and asyncio task) that entered it
and for the autograd work that thread runs itself (a nested ``torch.autograd.grad`` runs its
hooks in the thread that called it), is restored on exit also when an exception leaves the
block, and never silences another thread's pass.
"""

from __future__ import annotations

import contextlib
import contextvars

#: true while curvopt itself re-runs modules or propagates curvature in this context
SUSPENDED: contextvars.ContextVar = contextvars.ContextVar("curvopt_suspended", default=False)


class _State:
    def __init__(self):
        self.collecting = None  # the router while a collect is open or armed, else None
        self.open = None  # the open curvopt.collect block, if any
        self.armed: tuple = ()  # weakref.ref to each armed collection, oldest first
        self.explicit: tuple = ()  # weakref.ref to each explicit optimizer's collection
        self.plain = False  # armed collections, all resting, no block: no pass will collect
        self.taken = False  # some hooks are taken off, their models resting (``resting``)

    @staticmethod
    @contextlib.contextmanager
    def suspend():
        """Forward and gradient hooks do nothing inside this block, in this context only."""
        token = SUSPENDED.set(True)
        try:
            yield
        finally:
            SUSPENDED.reset(token)


STATE = _State()
