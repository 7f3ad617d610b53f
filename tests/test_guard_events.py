"""A guard observes the events whose methods its class overrides (``PassGuard.observes``,
found when the class is made), and ``Observers`` lists those bound methods, guards in order."""

from curvopt.guards.checks import Checks
from curvopt.guards.flow import FlowCheck
from curvopt.guards.observer import EVENTS, Observers, PassGuard


class _Loss(PassGuard):
    def loss(self, event):
        pass


class _LossAndEnd(_Loss):
    def finish(self, ending):
        pass


def _overridden(cls) -> set:
    return {e for e in EVENTS if getattr(cls, e) is not getattr(PassGuard, e)}


def test_each_guard_class_observes_what_it_overrides():
    for cls in (_Loss, _LossAndEnd, FlowCheck, Checks):
        assert set(cls.observes) == _overridden(cls), cls
    assert _LossAndEnd.observes == ("loss", "finish")  # inherited and own, in EVENTS' order
    assert PassGuard.observes == ()


def test_observers_list_the_bound_methods_in_the_guards_order():
    first, second, bare = _LossAndEnd(), _Loss(), PassGuard()
    observers = Observers((first, bare, second))
    assert observers.loss == [first.loss, second.loss]
    assert observers.finish == [first.finish]
    for event in ("module", "total", "parameter", "release"):
        assert getattr(observers, event) == []
