"""The guards of one backward pass's hooks, each raising with the fix: the loss is reduced, it
is an extended one where curvature is asked, every module sees the same batch; and autocast off
while curvopt computes."""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from curvopt.errors import MissingLossError, UnsupportedLossError, module_error

_NO_OP = contextlib.nullcontext()


def autocast_off() -> contextlib.AbstractContextManager:
    """Autocast disabled while curvopt computes (a backward pass run inside ``autocast`` would
    otherwise compute the quantities in whatever dtype each op's autocast policy picks)."""
    if not (torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")):
        return _NO_OP
    stack = contextlib.ExitStack()
    for device in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device):
            stack.enter_context(torch.autocast(device, enabled=False))
    return stack


def missing_loss(exts) -> MissingLossError:
    """The error for a module hook of a pass computing ``exts`` (second order) before any
    loss record's: the loss backpropagated is none curvopt reads."""
    names = ", ".join(repr(e) for e in exts)
    return MissingLossError(
        f"{names} need(s) the loss, and curvopt could not read the loss that was "
        "backpropagated; compute it with an extended loss module, e.g. "
        "lossfunc = curvopt.extend(torch.nn.CrossEntropyLoss()) (with the Trainer, "
        "compute_loss_func=), or functionally from the outputs of the extended "
        "model called inside the collect block (or, for an optimizer, after it was "
        "made): F.cross_entropy, F.nll_loss after F.log_softmax over the classes, "
        "F.mse_loss, F.binary_cross_entropy_with_logits, reduction 'mean' or 'sum' "
        "(a loss the model returns itself, e.g. a Hugging Face model's labels=, "
        "also without label_smoothing), summed and scaled by constants"
    )


def one_batch_size(call, seen: Optional[int]) -> int:
    """The batch size of the pass (``seen``: that of the calls before, None for the first),
    checked against ``call``'s."""
    n = call.batch_size
    if seen is None or n == seen:
        return n
    raise module_error(
        call.module,
        f"it sees {n} samples along dim {call.batch_dim} while other modules saw "
        f"{seen}; per-sample quantities need the batch dimension kept intact "
        "(do not fold other dims into it before a layer with parameters; sequence-first "
        "models: extend the loss module too, so that curvopt can find the batch, declare "
        "curvopt.extend(model, sequence_first=True), or use batch_first=True; a module "
        "called without the batch whose output is added to every sample, such as "
        "position embeddings of a shared arange(T): "
        "extend the loss module too, curvopt.extend(lossfunc), so that curvopt can "
        "follow the broadcast, or index them per sample, "
        "pos_emb(torch.arange(T).expand(N, T)))",
    )


def check_reduction(loss_module) -> None:
    if getattr(loss_module, "reduction", None) == "none":
        raise UnsupportedLossError(
            f"{type(loss_module).__name__}(reduction='none') returns per-sample losses, whose "
            "scaling curvopt cannot know; use reduction='mean' or 'sum'"
        )
