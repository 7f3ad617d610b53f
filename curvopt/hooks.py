"""``extend``: forward hooks that leave, on each output's autograd node, what backward needs.

Outside ``collect`` a hook only keeps references to inputs that autograd already saved for
the weight gradient, and drops them as soon as the gradient passes the module; nothing is
computed. Hooks are installed on every module that owns parameters (and on losses).
"""

from __future__ import annotations

import itertools
import weakref
from typing import List, Optional, Set, Tuple

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook

from curvopt.errors import GraphReuseError
from curvopt.layers import rule_for
from curvopt.layers.generic import owned_parameters
from curvopt.records import output_tensors
from curvopt.state import STATE

_HOOKED = "_curvopt_hooked"
#: key of the autograd-node metadata listing the module calls whose output the node produced
_METADATA = "curvopt"
_SEQUENCE = itertools.count()
#: every module with parameters that ``extend`` hooked
_EXTENDED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


class Record:
    """One call of an extended module: its inputs until the gradient w.r.t. its output arrives."""

    __slots__ = ("module", "args", "kwargs", "out_numel", "seq")

    def __init__(self, module, args, kwargs, out_numel):
        self.module, self.args, self.kwargs, self.out_numel = module, args, kwargs, out_numel
        self.seq = next(_SEQUENCE)  # forward order
        module._curvopt_live += 1

    def release(self):
        """Drop the inputs; the module has one call fewer awaiting its gradient."""
        if self.args is not None:
            self.args = self.kwargs = None
            self.module._curvopt_live -= 1

    def __del__(self):
        self.release()

    def on_grad(self, grad):
        self._dispatch((grad,))

    def on_grads(self, grads):
        self._dispatch(tuple(grads))

    def _dispatch(self, grads):
        if STATE.suspended:
            return
        if self.args is None:
            if STATE.collecting is not None:
                raise GraphReuseError(
                    f"curvopt: a second backward pass through the graph of module "
                    f"{self.module._curvopt_path!r} inside collect; each backward pass inside "
                    "collect needs its own forward pass (retain_graph=True is not enough, "
                    "the module inputs were released after the first pass)"
                )
            return
        try:
            if STATE.collecting is not None:
                STATE.collecting.backward_pass().on_module(self, grads)
        finally:
            self.release()


def owned(module: nn.Module) -> List[Tuple[str, nn.Parameter]]:
    """``(name, parameter)`` pairs the module's rule handles, looked up now (not at extend)."""
    if module._curvopt_owns_children:
        return list(module.named_parameters())
    return [(name, p) for name, p in module._parameters.items() if p is not None]


def trainable(module: nn.Module) -> List[Tuple[str, nn.Parameter]]:
    return [(name, p) for name, p in owned(module) if p.requires_grad]


def shared_parameters() -> Set[int]:
    """ids of parameters owned by more than one extended module (weight tying)."""
    seen, shared = set(), set()
    for module in list(_EXTENDED):
        for _, p in owned(module):
            (shared if id(p) in seen else seen).add(id(p))
    return shared


def _module_forward_hook(module, args, kwargs, output):
    if STATE.suspended or not torch.is_grad_enabled():
        return
    if not any(p.requires_grad for _, p in owned(module)):
        return
    outputs = [t for t in output_tensors(output) if t.requires_grad]
    if not outputs:
        return
    record = Record(module, args, kwargs, tuple(t.numel() for t in outputs))
    for index, t in enumerate(outputs):
        if t.grad_fn is not None:
            t.grad_fn.metadata.setdefault(_METADATA, []).append((record, index, t.output_nr))
    if len(outputs) == 1:
        outputs[0].register_hook(record.on_grad)
    else:
        register_multi_grad_hook(outputs, record.on_grads, mode="all")


def _loss_forward_hook(module, args, kwargs, output):
    if STATE.suspended or not torch.is_grad_enabled() or not output.requires_grad:
        return
    from curvopt.second_order import LossRecord

    record = LossRecord(module, args, kwargs)
    output.register_hook(record.on_grad)


def _hook(module: nn.Module, path: str, fn) -> None:
    module._curvopt_path = path or type(module).__name__
    if getattr(module, _HOOKED, False):
        return
    module.register_forward_hook(fn, with_kwargs=True)
    setattr(module, _HOOKED, True)


def _parameter_hook(p: nn.Parameter):
    def check(grad):
        if not STATE.suspended and STATE.collecting is not None:
            STATE.collecting.backward_pass().on_parameter_grad(p, grad)

    return check


def _install(module: nn.Module, path: str) -> None:
    rule = rule_for(module)
    params = owned_parameters(module, rule.owns_children)
    for p in params.values():
        if p.requires_grad and not getattr(p, "_curvopt_checked", False):
            p.register_hook(_parameter_hook(p))
            p._curvopt_checked = True
    if params:
        module._curvopt_owns_children = rule.owns_children
        if not hasattr(module, "_curvopt_live"):
            module._curvopt_live = 0
        _EXTENDED.add(module)
        _hook(module, path, _module_forward_hook)
    if rule.owns_children:
        return
    for name, child in module.named_children():
        _install(child, f"{path}.{name}" if path else name)


def extend(module: nn.Module, name: Optional[str] = None) -> nn.Module:
    """Install curvopt's hooks on ``module`` (a model, any submodule, or a loss) and return it.

    Idempotent. An extended model computes exactly what the plain model computes; the hooks only
    act inside :func:`curvopt.collect`.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"curvopt.extend expects a torch.nn.Module, got {type(module).__name__}")
    if isinstance(module, nn.modules.loss._Loss):
        _hook(module, name or "", _loss_forward_hook)
        return module
    _install(module, name or "")
    return module
