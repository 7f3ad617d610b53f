"""The guards as observers of one backward pass.

A pass (``loop.backward.BackwardPass``) has four events, and a guard attaches to those it
checks by overriding their methods of :class:`PassGuard` (the others do nothing):

* ``loss``: an extended loss's curvature was computed (``LossEvent``: the walk of its input, the
  node of its output, and the pass's ``active()``/``abort()`` for hooks that outlive the event);
* ``module``: a module call's output gradient arrived (``ModuleEvent``: the call's record, its
  output gradients, the ``(name, p)`` this pass accumulates into, whether the curvature's flow
  is checked at it);
* ``total``: the engine computed one call's ``sum_n g_n`` of a parameter, in full or through
  the pass's random probes (``engine.reducer.FirstOrderReducer.add_total``);
* ``parameter``: a parameter's whole gradient of the pass arrived;
* ``finish``: the pass ends without an error (``Ending``: the result buffer, the curvature
  attributes asked, the materialised per-sample gradients); the last chance to raise.

``release`` runs once the pass has ended, finished or failed. The pass calls its guards in the
order it attached them, at every event; a guard raises to fail the pass (nothing is written
then) and never writes a result itself.
"""

from __future__ import annotations

from typing import Callable, NamedTuple


class LossEvent(NamedTuple):
    """An extended loss's curvature was computed: ``walk`` (``graph.walk.Walk`` of its input),
    ``node`` (its output's autograd node), ``active()`` (whether the pass still computes) and
    ``abort()`` (ends the pass on an error), for hooks a guard leaves on the graph. A named
    tuple, as :class:`ModuleEvent` (a frozen dataclass sets each field by a Python call)."""

    walk: object
    node: object
    active: Callable[[], bool]
    abort: Callable[[], None]


class ModuleEvent(NamedTuple):
    """A module call's output gradients ``grads`` (batch first) arrived: ``record`` the call's
    ``core.records.Record``, ``params`` the ``(name, p)`` of its module this pass accumulates
    into; ``curvature``: the pass computes curvature and this call's gradient belongs to its own
    autograd task (inside a re-run checkpoint, torch's nested backward is checked at the
    checkpoint's node instead). One per module call: a named tuple, made in half the time of a
    frozen dataclass."""

    record: object
    grads: tuple
    params: list
    curvature: bool


class Ending(NamedTuple):
    """What a pass that ends without an error hands its guards: the ``results`` buffer
    (``engine.results.ResultBuffer``), the curvature attributes ``attrs`` it was asked for, and
    ``batch_grads`` (``id(p) -> (p, [N, *p.shape])``, the materialised per-sample gradients).
    A named tuple, as :class:`ModuleEvent`."""

    results: object
    attrs: set
    batch_grads: dict


#: the events of a pass, in the order :class:`Observers` lists them
EVENTS = ("loss", "module", "total", "parameter", "finish", "release")


class PassGuard:
    """A check of one backward pass, attached to the events it observes: ``observes``, the
    events whose methods its class overrides, found when the class is made."""

    observes: tuple = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.observes = tuple(e for e in EVENTS if getattr(cls, e) is not getattr(PassGuard, e))

    def loss(self, event: LossEvent) -> None:
        """An extended loss's curvature was computed."""

    def module(self, event: ModuleEvent) -> None:
        """A module call's output gradient arrived."""

    def total(self, p, use, total, projected) -> None:
        """One call's ``sum_n g_n`` of ``p`` (``use``: its ``(rule, call, name)``): ``total``
        ``[*p.shape]``, or ``None`` where it was seen through probes, ``projected = ((u, v),
        [K] projected sum, magnitude sum_r |b_r| |a_r|)`` (``None`` otherwise)."""

    def parameter(self, p, grad, kept) -> None:
        """``p``'s whole gradient of this pass arrived (``kept``: what the pass keeps of it,
        ``core.passgrad.held``, for reading it back at the end)."""

    def finish(self, ending: Ending) -> None:
        """The pass ends without an error so far: raise to fail it."""

    def release(self) -> None:
        """The pass ended (finished or failed): drop hooks and references."""


class Observers:
    """The guards of one pass, in order, as each event's observers: the bound methods of the
    guards that attach to it (a guard's method that is :class:`PassGuard`'s own is not called:
    ``PassGuard.observes``)."""

    def __init__(self, guards):
        # (one list each, written out: per guard and event a ``getattr`` and an ``append``
        # cost two Python calls a pass, a list comprehension one an event)
        self.loss = [g.loss for g in guards if "loss" in g.observes]
        self.module = [g.module for g in guards if "module" in g.observes]
        self.total = [g.total for g in guards if "total" in g.observes]
        self.parameter = [g.parameter for g in guards if "parameter" in g.observes]
        self.finish = [g.finish for g in guards if "finish" in g.observes]
        self.release = [g.release for g in guards if "release" in g.observes]
