"""Modules that ``curvopt.extend`` did not reach, seen in a backward pass inside ``collect``.

While a ``collect`` block is open, a global forward hook (:func:`watch`) notes every call of a
module that is not extended and owns trainable parameters, with grad enabled; if a backward
pass then reaches that call's output and will accumulate into one of those parameters, at the
end of that pass:

* no extended module or loss took part in it (``collect.ran(task)`` is false): nothing can be
  written for it, so it raises, naming the module and ``curvopt.extend``, instead of leaving
  every parameter without its attribute;
* otherwise (a submodule extended, the rest not) the module's parameters get nothing while the
  others get their quantities: a warning names the module, once per module.

Calls made before the block (a forward outside ``collect``, only the backward inside) are not
seen; curvopt's own re-runs (``SUSPENDED``) are skipped.
"""

from __future__ import annotations

import warnings
import weakref

import torch
from torch import nn

from curvopt.errors import UnsupportedModuleError
from curvopt.core.extended import is_extended
from curvopt.core.state import STATE, SUSPENDED
from curvopt.autograd.torch_internals import (
    current_graph_task_id,
    grad_accumulator,
    queue_callback,
    will_engine_execute_node,
)

#: modules already warned about (a submodule extended, this one not)
_WARNED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def watch():
    """The global forward hook of an open ``collect`` block (a handle to remove at its end)."""
    return nn.modules.module.register_module_forward_hook(_forward)


def _forward(module, inputs, output) -> None:
    if SUSPENDED.get() or STATE.open is None or not torch.is_grad_enabled():
        return
    if is_extended(module) or not isinstance(output, torch.Tensor) or not output.requires_grad:
        return
    # a child of a module whose rule owns it (MultiheadAttention's out_proj) is extended with it
    params = [p for p in module.parameters(recurse=False) if p.requires_grad and not is_extended(p)]
    if params:
        collecting = STATE.open
        output.register_hook(lambda grad: _reached(collecting, module, params))


def _accumulates(p) -> bool:
    """Whether the running backward pass will accumulate into ``p.grad``."""
    try:
        return will_engine_execute_node(grad_accumulator(p))
    except RuntimeError:  # an input of torch.autograd.grad
        return False


def _reached(collecting, module, params) -> None:
    if SUSPENDED.get() or not any(_accumulates(p) for p in params):
        return
    task = current_graph_task_id()
    queue_callback(lambda: _check(collecting, task, module))


def _check(collecting, task: int, module) -> None:
    name = type(module).__name__
    if not collecting.ran(task):
        raise UnsupportedModuleError(
            f"curvopt.collect: a backward pass inside the block ran through module {name}, "
            "which has trainable parameters, but through nothing extended. Extend the model "
            "and the loss, model = curvopt.extend(model), lossfunc = "
            "curvopt.extend(nn.CrossEntropyLoss()); see "
            "docs/support.md#modules-that-are-not-extended."
        )
    if module not in _WARNED:
        _WARNED.add(module)
        warnings.warn(
            f"curvopt.collect: module {name} took part in a backward pass with trainable "
            "parameters but is not extended, so its parameters get no quantities. Pass the "
            "whole model to curvopt.extend (extend the whole model); see "
            "docs/support.md#modules-that-are-not-extended.",
            stacklevel=2,
        )
