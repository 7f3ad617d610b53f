"""The guards of one backward pass's hooks, each raising with the fix: the loss is reduced, it
is an extended one where curvature is asked, every module sees the same batch; and autocast off
while curvopt computes."""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from curvopt.autograd.torch_internals import any_autocast_enabled
from curvopt.errors import MissingLossError, batch_mismatch, reduction_none_error


def without_autocast(fn, *args):
    """``fn(*args)`` with autocast disabled while curvopt computes (a backward pass run inside
    ``autocast`` would otherwise compute the quantities in whatever dtype each op's autocast
    policy picks). Where autocast is off already (the usual case: one read), ``fn`` is called
    as it is, with no context entered (two Python calls a hook fewer)."""
    if not any_autocast_enabled():
        return fn(*args)
    with contextlib.ExitStack() as stack:
        for device in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        return fn(*args)


def missing_loss(exts) -> MissingLossError:
    """The error for a module hook of a pass computing ``exts`` (second order) before any
    loss record's: the loss backpropagated is none curvopt reads. The extensions are named by
    their class (their options can hold an optimizer's internal callables, such as the bases an
    ``optim.EKFAC`` supplies)."""
    names = ", ".join(dict.fromkeys(type(e).__name__ for e in exts))
    return MissingLossError(
        f"{names} need(s) the loss, but curvopt could not read the loss that was "
        "backpropagated. Compute it with lossfunc = curvopt.extend(nn.CrossEntropyLoss()) "
        "(Trainer: compute_loss_func=) or F.cross_entropy on the extended model's output; see "
        "docs/support.md#missing-extended-loss."
    )


def one_batch_size(call, seen: Optional[int]) -> int:
    """The batch size of the pass (``seen``: that of the calls before, None for the first),
    checked against ``call``'s."""
    n = call.batch_size
    if seen is None or n == seen:
        return n
    raise batch_mismatch(call.module, call.batch_dim, n, seen)


def check_reduction(loss_module) -> None:
    if getattr(loss_module, "reduction", None) == "none":
        raise reduction_none_error(type(loss_module).__name__)
