"""Where the gradient hooks go: to the backward pass now running of every active collection.
This module routes hooks and chooses no computation (what a pass computes is ``engine``'s).

``extend`` (``hooks``) registers the hooks made here on each module call's output
(``module_hook``), each extended loss's output (``loss_hook``) and each parameter
(``parameter_hook``); a record is data (``records``), and which passes its gradient goes to is
decided here. While a ``collect`` block is open or a collection armed, ``STATE.collecting`` is
:data:`ROUTER`, which hands each hook to the pass of every active collection (the open block
first, then the armed ones, newest first; ``collect.collect.backward_pass``: created at the
pass's first hook); otherwise the hooks only drop what the forward kept.
"""

from __future__ import annotations

from typing import Optional

from curvopt.core.extended import module_path
from curvopt.core.state import STATE, SUSPENDED
from curvopt.errors import GraphReuseError


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


class Router:
    """``STATE.collecting`` while a collection is open or armed: the passes of every active one
    (``outer``: the autograd task that ran the forward of the call asking, see
    ``collect.collect.backward_pass``)."""

    def backward_pass(self, outer: Optional[int] = None):
        if not STATE.armed and STATE.open is not None:  # the usual case: one open block
            found = STATE.open.backward_pass(outer)
            if found is not None:
                return found
        active = [STATE.open] + [ref() for ref in reversed(STATE.armed)]
        passes = [c.backward_pass(outer) for c in active if c is not None]
        passes = [p for p in passes if p is not None]
        return passes[0] if len(passes) == 1 else _Passes(passes)


ROUTER = Router()


def module_hook(record, several: bool = False):
    """The gradient hook of a module call's output (``several``: of all its outputs at once,
    ``register_multi_grad_hook``)."""

    def hook(grads):
        _on_module(record, tuple(grads) if several else (grads,))

    return hook


def _on_module(record, grads) -> None:
    if SUSPENDED.get():
        return
    if len(grads) == 1:  # (the usual case: no generator, which costs a call a step)
        grads = (record.shaped(0, grads[0]),)
    else:
        grads = tuple(record.shaped(i, g) for i, g in enumerate(grads))
    for tap in record.extended.taps:
        tap.differentiated(record, grads)
    if record.args is None:
        if STATE.collecting is not None:
            raise GraphReuseError(
                f"curvopt: a second backward pass inside collect through the graph of module "
                f"{module_path(record.module)!r}, whose inputs the first pass released. Run a "
                "forward pass for each backward pass inside collect (retain_graph=True is not "
                "enough); see docs/support.md#several-backward-passes."
            )
        return
    used = True  # False: a pass that leaves this call alone, for another pass to use
    try:
        if STATE.collecting is not None:
            used = ROUTER.backward_pass(record.outer).on_module(record, grads)
    finally:
        if used:
            record.release()


def loss_hook(record):
    """The gradient hook of an extended loss's output (``record``: its ``LossRecord``)."""

    def hook(grad):
        on_loss(record, grad)

    return hook


def on_loss(record, grad) -> None:
    """The gradient ``grad`` reached the loss of ``record`` (also called by ``recognize`` for a
    loss read off the graph)."""
    if SUSPENDED.get() or record.args is None:
        return
    used = True
    try:
        if STATE.collecting is not None:
            used = ROUTER.backward_pass().on_loss(record, grad)
    finally:
        if used:
            record.args = record.kwargs = None


def parameter_hook(p):
    """The gradient hook of an extended module's parameter ``p``."""

    def hook(grad):
        if not SUSPENDED.get() and STATE.collecting is not None:
            ROUTER.backward_pass().on_parameter_grad(p, grad)

    return hook
