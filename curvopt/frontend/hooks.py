"""``extend``: forward hooks that leave, on each output's autograd node, what backward needs.

Outside ``collect`` a hook only keeps references to inputs that autograd already saved for
the weight gradient, and drops them as soon as the gradient passes the module; nothing is
computed. Hooks are installed on every module that owns parameters (and on losses).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook

from curvopt.loop.dispatch import module_hook, parameter_hook
from curvopt.layers import rule_for
from curvopt.core.params import HOOKED, is_extended, note_extended, owned, owned_parameters
from curvopt.entry.recognize import returned_loss, watch
from curvopt.entry.functional import hook_loss, wants_loss, watch_outputs
from curvopt.core.records import (
    Record,
    anchor,
    note_random_state,
    output_tensors,
    take_random_state,
)
from curvopt.core.state import STATE

__all__ = ["extend", "is_extended", "Record"]

_RETURNS_LOSS = "_curvopt_returned_loss_hooked"
_SEQUENCE_FIRST = "_curvopt_sequence_first"


def _random_state_hook(module, args, kwargs):
    """Before the forward of a module whose rule re-runs it: the generator state it draws from,
    where it draws (``LayerRule.draws_random``)."""
    if STATE.suspended or not torch.is_grad_enabled() or not rule_for(module).draws_random(module):
        return
    first = next((x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)), None)
    if first is not None:
        note_random_state(module, first.device)


def _module_forward_hook(module, args, kwargs, output):
    random = take_random_state(module)
    if STATE.suspended or not torch.is_grad_enabled():
        return
    if not any(p.requires_grad for _, p in owned(module)):
        return
    outputs = [t for t in output_tensors(output) if t.requires_grad]
    if not outputs:
        return
    rule = rule_for(module)
    anchors = [anchor(outputs[0], (*args, *kwargs.values()))] if len(outputs) == 1 else outputs
    record = Record(
        module, args, kwargs, outputs, rule.batch_dim(module), rule.positionwise, anchors, random
    )
    if rule.positionwise and getattr(module, _SEQUENCE_FIRST, False) and outputs[0].dim() >= 3:
        record.transposed = True  # declared: extend(model, sequence_first=True)
    if len(anchors) == 1:
        anchors[0].register_hook(module_hook(record))
    else:
        register_multi_grad_hook(anchors, module_hook(record, several=True), mode="all")


def _loss_forward_hook(module, args, kwargs, output):
    if STATE.suspended or not torch.is_grad_enabled() or not output.requires_grad:
        return
    hook_loss(module, args, kwargs, output)


def _returned_loss_hook(module, args, kwargs, output):
    """While a collection is open or armed: a loss the model computed itself (Hugging Face's
    ``labels=``) read from the graph (``recognize``), and, where the collection needs the loss,
    the other outputs watched for a loss computed from them after the forward
    (``functional``)."""
    if STATE.suspended or STATE.collecting is None or not torch.is_grad_enabled():
        return
    loss = returned_loss(output)
    if loss is not None:
        watch(loss)
    if wants_loss(module):
        watch_outputs(output, loss)


def _hook(module: nn.Module, path: str, fn, before=None) -> None:
    module._curvopt_path = path or type(module).__name__
    if getattr(module, HOOKED, False):
        return
    if before is not None:
        module.register_forward_pre_hook(before, with_kwargs=True)
    module.register_forward_hook(fn, with_kwargs=True)
    setattr(module, HOOKED, True)


def _install(module: nn.Module, path: str, sequence_first: bool) -> None:
    rule = rule_for(module)
    if sequence_first:
        setattr(module, _SEQUENCE_FIRST, True)
    params = owned_parameters(module, rule.owns_children)
    for name, p in params.items():
        if p.requires_grad and not getattr(p, "_curvopt_checked", False):
            p.register_hook(parameter_hook(p))
            p._curvopt_checked = True
        if not hasattr(p, "_curvopt_path"):
            p._curvopt_path = f"{path}.{name}" if path else name
    if params:
        module._curvopt_owns_children = rule.owns_children
        if not hasattr(module, "_curvopt_live"):
            module._curvopt_live = 0
        note_extended(module)
        _hook(
            module,
            path,
            _module_forward_hook,
            _random_state_hook if rule.replays_random_forward else None,
        )
    if rule.owns_children:
        return
    for name, child in module.named_children():
        _install(child, f"{path}.{name}" if path else name, sequence_first)


def extend(
    module: nn.Module, name: Optional[str] = None, sequence_first: bool = False
) -> nn.Module:
    """Install curvopt's hooks on ``module`` (a model, any submodule, or a loss) and return it.

    Idempotent. An extended model computes exactly what the plain model computes; the hooks only
    act inside :func:`curvopt.collect`.

    ``sequence_first=True`` declares that the positionwise layers (``Linear``, ``Embedding``,
    norms) see ``[T, N, ...]``: their batch is dim 1. curvopt finds that by itself where a layer
    with a fixed batch dim (``MultiheadAttention(batch_first=False)``, a convolution) or a
    broadcast position embedding anchors the batch; a model made of positionwise layers only
    has nothing to tell ``[T, N]`` from ``[N, T]``, and is read batch-first unless declared.

    Args:
        module: a model, any submodule, or a loss module.
        name: the path the error messages give the module (default: its attribute path).
        sequence_first: the position-wise layers see ``[T, N, ...]``.

    Returns:
        ``module`` itself, hooked.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.

    Example::

        model = curvopt.extend(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)))
        lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"curvopt.extend expects a torch.nn.Module, got {type(module).__name__}")
    if isinstance(module, nn.modules.loss._Loss):
        _hook(module, name or "", _loss_forward_hook)
        return module
    reached = is_extended(module)  # hooked as a part of a model extended before
    _install(module, name or "", sequence_first)
    if not (reached or getattr(module, _RETURNS_LOSS, False)):
        module.register_forward_hook(_returned_loss_hook, with_kwargs=True)
        setattr(module, _RETURNS_LOSS, True)
    return module
