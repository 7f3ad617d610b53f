"""Process-wide state shared by the forward hooks and the backward pass.

``collecting`` is what the hooks dispatch a backward pass to (``collect``'s dispatcher), set
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
step compute nothing, so the forward hooks return at once (no record, no gradient hook) and
forward and backward cost what the plain model's cost.
"""

from __future__ import annotations

import contextlib


class _State:
    def __init__(self):
        self.collecting = None  # the dispatcher while a collect is open or armed, else None
        self.open = None  # the open curvopt.collect block, if any
        self.armed: tuple = ()  # weakref.ref to each armed collection, oldest first
        self.explicit: tuple = ()  # weakref.ref to each explicit optimizer's collection
        self.plain = False  # armed collections, all resting, no block: the hooks do nothing
        self.suspended = 0  # >0 while curvopt itself re-runs modules or propagates curvature

    @contextlib.contextmanager
    def suspend(self):
        """Forward and gradient hooks do nothing inside this block."""
        self.suspended += 1
        try:
            yield
        finally:
            self.suspended -= 1


STATE = _State()
