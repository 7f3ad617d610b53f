"""Losses an extended model computes functionally itself (a Hugging Face model's own
``labels=`` loss), found in the autograd graph of the loss the model returns.

When an extended model's forward returns a loss (a scalar, a tuple starting with one, or a
mapping with ``"loss"``) while a collection is open or armed, the graph of that loss is read
right away, while every node still holds what it saved, down to the model's outputs (the
nodes of extended module calls). Each term reached through linear combinations of scalars only
(sums, differences, products and quotients by constants) and read exactly becomes the
``LossRecord`` an extended loss module would have made, with the same module options:

* ``F.cross_entropy(x, y, weight, ignore_index, reduction)`` and ``F.nll_loss(F.log_softmax(x,
  1), y, ...)`` (one graph: ``NllLossBackward0 <- LogSoftmaxBackward0``):
  ``CrossEntropyLoss`` on the log-probabilities ``z = log_softmax(x)``. Its factor is exact at
  ``x`` too: ``softmax(z) = softmax(x)``, and each column ``s`` sums to 0 over the classes, so
  the log-softmax's transposed Jacobian ``s - p 1^T s`` passes it unchanged;
* ``F.mse_loss`` (``MseLossBackward0``): ``MSELoss``;
* ``F.binary_cross_entropy_with_logits`` (``BinaryCrossEntropyWithLogitsBackward0``):
  ``BCEWithLogitsLoss`` with its ``weight`` and ``pos_weight``.

The record's hook is a pre-hook on the term's node, so it receives what an extended loss's
output would: ``d total / d term``, which carries every factor outside the term (HF's division
of a "sum" by ``num_items_in_batch``, a weighted sum of several terms). The output of an
extended loss module's call is left to that module's own hook. Where a term cannot be read
(label smoothing, ``reduction="none"``, a log-softmax feeding anything else) or enters the
loss nonlinearly (``exp(loss)``, a product of two terms), nothing is read and the loss is as
without ``extend``: second order raises ``MissingLossError``. A further part that is no term
(a custom penalty beside a cross-entropy) is left alone; the engine's gradient-flow check
raises for it. Nothing is guessed.

Only a loss the model returns is read: one computed after the forward (``F.cross_entropy(
model(x), y)``) is seen by curvopt's hooks only once its nodes have run and freed what they
saved. ``DiagHessian`` raises for a cross-entropy read here: the log-softmax's curvature is the
loss's, and the record's input is its output.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import List, Optional, Tuple

import torch
from torch import nn

from curvopt.loop.routing import on_loss
from curvopt.graph.search import read_down
from curvopt.core.records import LossRecord, is_extended_loss, records_on
from curvopt.autograd.torch_internals import (
    BCE_WITH_LOGITS,
    LOG_SOFTMAX,
    LOSS_COMBINATIONS,
    MSE_LOSS,
    NLL_LOSS,
    NLL_LOSS_2D,
    REDUCTIONS,
    VIEW,
    saved,
)


def returned_loss(output) -> Optional[torch.Tensor]:
    """The loss a model's forward returned: the output itself when it is a scalar, the first
    item of a tuple, a mapping's ``"loss"`` (Hugging Face's ``ModelOutput``); else None."""
    if isinstance(output, Mapping):
        output = output.get("loss")
    elif isinstance(output, (tuple, list)) and output:
        output = output[0]
    if (
        isinstance(output, torch.Tensor)
        and output.dim() == 0
        and output.is_floating_point()
        and output.grad_fn is not None
    ):
        return output
    return None


def watch(loss: torch.Tensor) -> int:
    """Find the terms of ``loss``'s graph (see module doc) and hook each; the number found."""
    found = recognise(loss)
    for node, record in found:
        node.register_prehook(_hook(record))
    return len(found)


def _hook(record: LossRecord):
    def on_term(grad_outputs):
        on_loss(record, grad_outputs[0])

    return on_term


def recognise(loss: torch.Tensor) -> List[Tuple[object, LossRecord]]:
    """``(node, record)`` of every term of ``loss``; [] where a term cannot be read exactly or
    enters the loss other than linearly (``exp(loss)``): then nothing is read."""
    terms = []

    def expand(node, linear, nexts):
        """Walk the loss's graph down to the model's outputs (the nodes of extended module
        calls) and the log-softmaxes; ``linear``: only linear combinations of scalars lie
        between ``node`` and the loss (the root: True)."""
        linear = linear is None or linear
        kind = type(node).__name__
        if is_extended_loss(node):
            return None  # an extended loss module's output: hooked by the module already
        if kind == LOG_SOFTMAX or records_on(node):
            return None
        if kind in _TERMS:
            terms.append((node, linear))
            if kind not in _NLL:
                return None
        return linear and _combines_linearly(kind, nexts)

    inputs, consumers = read_down(loss.grad_fn, expand)
    found = []
    for node, linear in terms:
        kind = type(node).__name__
        if kind in _NLL:
            record = _cross_entropy(node, inputs, consumers)
        elif kind == MSE_LOSS:
            record = _record(node, nn.MSELoss, ())
        else:
            record = _record(node, nn.BCEWithLogitsLoss, ("weight", "pos_weight"))
        if record is None or not linear:
            return []
        found.append((node, record))
    return found


_NLL = {NLL_LOSS, NLL_LOSS_2D}
_TERMS = _NLL | {MSE_LOSS, BCE_WITH_LOGITS}

NO_HESSIAN = (
    "DiagHessian: the model computes F.cross_entropy itself, so curvopt sees the loss only from "
    "the log-probabilities. Compute the loss from the logits with lossfunc = "
    "curvopt.extend(nn.CrossEntropyLoss()), or use DiagGGNExact; see "
    "docs/support.md#missing-extended-loss."
)


def _combines_linearly(kind, nexts) -> bool:
    """A node of type ``kind`` with inputs ``nexts`` combines scalars linearly: one operand of
    a product or quotient is constant (None)."""
    if kind not in LOSS_COMBINATIONS:
        return False
    if kind == "MulBackward0":
        return sum(fn is not None for fn in nexts) == 1
    if kind == "DivBackward0":
        return nexts[1] is None
    return True


def _reduction(node) -> Optional[str]:
    reduction = REDUCTIONS.get(saved(node, "reduction"))
    return reduction if reduction in ("mean", "sum") else None


def _cross_entropy(node, inputs, consumers) -> Optional[LossRecord]:
    """``CrossEntropyLoss`` on the log-probabilities ``[N, C, *d]`` of an ``nll_loss`` after a
    class-dim ``log_softmax`` that feeds nothing else; None otherwise."""
    below = _only_input(node, inputs, consumers)
    view = below if below is not None and type(below).__name__ == VIEW else None
    log_softmax = _only_input(view, inputs, consumers) if view is not None else below
    if log_softmax is None or type(log_softmax).__name__ != LOG_SOFTMAX:
        return None
    log_probs, target = saved(log_softmax, "result"), saved(node, "target")
    if log_probs.dim() < 2 or saved(log_softmax, "dim") % log_probs.dim() != 1:
        return None
    if view is not None:  # nll_loss's own view: the positions merged in order
        viewed = saved(node, "self").shape
        if type(node).__name__ != NLL_LOSS_2D or viewed[:2] != log_probs.shape[:2]:
            return None
        target = target.reshape(log_probs.shape[0], *log_probs.shape[2:])
    reduction = _reduction(node)
    if reduction is None:
        return None
    module = nn.CrossEntropyLoss(
        weight=saved(node, "weight"),
        ignore_index=saved(node, "ignore_index"),
        reduction=reduction,
    )
    return LossRecord(module, (log_probs, target), {}, NO_HESSIAN)


def _only_input(node, inputs, consumers):
    """The node ``node`` takes its first input from, where ``node`` is its only consumer."""
    below = inputs[node][0] if inputs.get(node) else None
    return below if below is not None and consumers.get(below) == 1 else None


def _record(node, loss_type, options) -> Optional[LossRecord]:
    """``loss_type`` with the node's reduction and ``options``, on its saved input and target."""
    reduction = _reduction(node)
    if reduction is None:
        return None
    module = loss_type(reduction=reduction, **{o: saved(node, o) for o in options})
    return LossRecord(module, (saved(node, "self"), saved(node, "target")), {})
