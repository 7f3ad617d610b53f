"""Losses computed functionally from an extended model's outputs, after its forward:
``F.cross_entropy(model(x), y)``, ``nn.CrossEntropyLoss()(model(x), y)`` on a loss module that
was not extended, ``F.nll_loss(F.log_softmax(model(x), 1), y)``, ``F.mse_loss``,
``F.binary_cross_entropy_with_logits``.

Such a loss's nodes run and free what they saved before any hook of curvopt sees the backward
pass, so it is caught where it is made. While a collection that needs the loss (second order)
is open or armed, the tensors an extended model returns are marked as :class:`Watched` (their
class is set in place: the same tensor objects, the same autograd graph, nothing copied).
Every torch function applied to a watched tensor runs as on a plain tensor; a result that
carries a gradient is watched in turn, so views, slices, ``.float()`` or a temperature
``out / T`` between the model and the loss keep it. A call of one of the losses above on a
watched input becomes the ``LossRecord`` of the equivalent loss module, with every option
of the call (``weight``, ``ignore_index``, ``label_smoothing``, ``pos_weight``, the
reduction, also the legacy ``size_average``/``reduce``), hooked on its output exactly as an
extended loss module's call is; its output is a plain tensor again.

``F.nll_loss`` is read as ``CrossEntropyLoss`` on log-probabilities only where its input is a
class-dim ``log_softmax`` (possibly viewed with the classes kept last, as language models
flatten ``[N, T, C]``), found on the input's node; a ``DiagHessian`` of it raises
(``recognize``'s reason: the log-softmax's curvature is the loss's). Any other loss (one
written out by hand, ``F.nll_loss`` on other log-probabilities, ``reduction="none"``) is not
read: second order raises ``MissingLossError`` naming how to pass it. A loss computed inside
an extended loss module is that module's (``curvopt.frontend.hooks``): its functional record is
dropped there.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn import _reduction

from curvopt.core.extended import set_path
from curvopt.losses import has_loss_rule
from curvopt.loop.routing import loss_hook, on_loss
from curvopt.core.calls import output_tensors
from curvopt.core.records import LossRecord, mark_extended_loss
from curvopt.entry.recognize import NO_HESSIAN
from curvopt.core.state import STATE, SUSPENDED
from curvopt.graph.search import edges_of
from curvopt.autograd.torch_internals import LOG_SOFTMAX, ROW_VIEWS, hook_gradient, saved

#: key, in the ``__dict__`` of a functional loss's result, of the handle of its hook
#: (:func:`_record`): the loss tensor curvopt's own call returned, kept with it as its hook is
_RECORD_HANDLE = "_curvopt_functional_record"


class Watched(torch.Tensor):
    """A tensor an extended model returned while a second-order collection was active (see
    the module doc). It behaves as a plain tensor; its ``repr`` is a plain tensor's."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        loss = _LOSSES.get(func)
        if loss is not None:
            _record(func, loss, args, kwargs, result)
            return result
        for t in output_tensors(result):
            _watch(t)
        return result

    def __repr__(self, *, tensor_contents=None):
        with torch._C.DisableTorchFunctionSubclass():
            return torch.Tensor.__repr__(self.as_subclass(torch.Tensor))


@torch.compiler.disable
def wants_loss(model: nn.Module) -> bool:
    """Whether the open collection, or an armed one whose parameters ``model`` holds, computes
    a second-order quantity (needs the loss). Run eagerly under ``torch.compile`` (a graph
    break in the forward hook): dynamo traced the armed collections' weak references as their
    referents and failed with a ``TypeError`` once two were alive."""
    block = STATE.open
    if block is not None and any(ext.order == 2 for ext in block.extensions):
        return True
    for ref in STATE.armed:
        armed = ref()
        if armed is None:
            continue
        extensions, _, scope, _ = armed.window()
        if any(ext.order == 2 for ext in extensions) and any(
            id(p) in scope for p in model.parameters()
        ):
            return True
    return False


def watch_outputs(output, loss: Optional[torch.Tensor] = None) -> None:
    """Mark the tensors of an extended model's ``output`` (a tensor, nested tuples or lists, or
    a mapping such as a Hugging Face ``ModelOutput``) but the ``loss`` it returned as
    :class:`Watched`."""
    if isinstance(output, Mapping):
        output = tuple(output.values())
    for t in output_tensors(output):
        if t is not loss:
            _watch(t)


def hook_loss(module: nn.Module, args, kwargs, output: torch.Tensor) -> None:
    """Hook ``output``, the result of the loss ``module`` on ``args``/``kwargs``, as an extended
    loss: its record receives ``d total / d output`` in the backward pass. A functional record
    made for the same output inside the module's forward is dropped: the module's own is kept.
    Where the module's class has no loss rule but returns such a call's result as it is
    (``nn.NLLLoss``, whose ``F.nll_loss`` after a ``log_softmax`` is read as a cross-entropy, or a
    user's class returning ``F.cross_entropy(...)``), the functional record is kept instead."""
    handle = output.__dict__.get(_RECORD_HANDLE)
    if handle is not None:
        if not has_loss_rule(module):
            return
        del output.__dict__[_RECORD_HANDLE]
        handle.remove()
    record = LossRecord(module, args, kwargs)
    hook_gradient(output, loss_hook(record))  # (for good: no removal handle)
    if output.grad_fn is not None:
        mark_extended_loss(output)


def _watch(t: torch.Tensor) -> None:
    if type(t) is torch.Tensor and t.grad_fn is not None and t.is_floating_point():
        t.__class__ = Watched


def _record(func, loss, args, kwargs, result) -> None:
    """Hook ``result``, a functional loss call's on a watched input: its record is made when
    the gradient reaches it (a call inside an extended loss module's forward, whose hook is
    dropped by :func:`hook_loss`, makes none)."""
    if SUSPENDED.get() or STATE.collecting is None or not isinstance(result, torch.Tensor):
        return
    if not result.requires_grad or result.grad_fn is None:
        return

    def on_grad(grad):
        found = loss(_SIGNATURES[func].bind(*args, **kwargs).arguments)
        if found is None:
            return  # not read: the pass raises MissingLossError
        module, inputs, no_hessian = found
        set_path(module, f"F.{func.__name__}")
        on_loss(LossRecord(module, inputs, {}, no_hessian), grad)

    handle = result.register_hook(on_grad)
    mark_extended_loss(result)
    result.__dict__[_RECORD_HANDLE] = handle  # on the loss tensor: it lives as long as its hook


def _reduction_of(call: Dict) -> Optional[str]:
    """The call's reduction (the legacy ``size_average``/``reduce`` included); None for
    ``"none"``, which has no scalar loss to differentiate twice."""
    if call.get("size_average") is not None or call.get("reduce") is not None:
        reduction = _reduction.legacy_get_string(call.get("size_average"), call.get("reduce"))
    else:
        reduction = call.get("reduction", "mean")
    return reduction if reduction in ("mean", "sum") else None


Found = Optional[Tuple[nn.Module, Tuple[torch.Tensor, torch.Tensor], Optional[str]]]


def _cross_entropy(call: Dict) -> Found:
    reduction = _reduction_of(call)
    if reduction is None:
        return None
    module = nn.CrossEntropyLoss(
        weight=call.get("weight"),
        ignore_index=call.get("ignore_index", -100),
        reduction=reduction,
        label_smoothing=call.get("label_smoothing", 0.0),
    )
    return module, (call["input"], call["target"]), None


def _nll_after_log_softmax(call: Dict) -> Found:
    """``F.nll_loss`` on log-probabilities ``[N, C, *d]``: ``CrossEntropyLoss`` on them, where
    they are a class-dim ``log_softmax`` (see the module doc)."""
    reduction, log_probs = _reduction_of(call), call["input"]
    if reduction is None or not _is_log_softmax(log_probs):
        return None
    module = nn.CrossEntropyLoss(
        weight=call.get("weight"), ignore_index=call.get("ignore_index", -100), reduction=reduction
    )
    return module, (log_probs, call["target"]), NO_HESSIAN


def _is_log_softmax(log_probs: torch.Tensor) -> bool:
    """``log_probs`` is ``log_softmax`` over its dim 1, or a view of one over its last dim that
    keeps the classes last (``[N, T, C] -> [N·T, C]``)."""
    node = log_probs.grad_fn
    if log_probs.dim() < 2 or node is None:
        return False
    if type(node).__name__ == LOG_SOFTMAX:
        return saved(node, "dim") % log_probs.dim() == 1
    if type(node).__name__ not in ROW_VIEWS or log_probs.dim() != 2:
        return False
    below = edges_of(node)[0][0] if edges_of(node) else None
    if below is None or type(below).__name__ != LOG_SOFTMAX:
        return False
    source = saved(below, "result")
    last = source.dim() - 1
    return saved(below, "dim") % source.dim() == last and source.shape[-1] == log_probs.shape[1]


def _mse(call: Dict) -> Found:
    reduction = _reduction_of(call)
    if reduction is None or call.get("weight") is not None:
        return None
    return nn.MSELoss(reduction=reduction), (call["input"], call["target"]), None


def _bce_with_logits(call: Dict) -> Found:
    reduction = _reduction_of(call)
    if reduction is None:
        return None
    module = nn.BCEWithLogitsLoss(
        weight=call.get("weight"), reduction=reduction, pos_weight=call.get("pos_weight")
    )
    return module, (call["input"], call["target"]), None


_LOSSES: Dict[Callable, Callable[[Dict], Found]] = {
    F.cross_entropy: _cross_entropy,
    F.nll_loss: _nll_after_log_softmax,
    F.mse_loss: _mse,
    F.binary_cross_entropy_with_logits: _bce_with_logits,
}
_SIGNATURES = {func: inspect.signature(func) for func in _LOSSES}
