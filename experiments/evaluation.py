"""Evaluation of a model on the splits, and the wall clock of the training loop."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .data import Split, Splits, eval_batches
from .distributed import DistInfo


class Clock:
    """Wall-clock seconds, waiting for queued GPU work first."""

    def __init__(self, device: torch.device):
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def __call__(self) -> float:
        self.sync()
        return time.perf_counter()


@torch.no_grad()
def split_sums(model, lossfunc, split: Split, batch_size: int, prep) -> tuple[float, int]:
    """``(sum of the per-sample losses, number correct)`` of ``model`` on ``split``."""
    loss_sum, correct = 0.0, 0
    for x, y in eval_batches(split, batch_size, prep):
        logits = model(x)
        loss_sum += lossfunc(logits, y).item() * len(y)
        correct += (logits.argmax(1) == y).sum().item()
    return loss_sum, correct


@torch.no_grad()
def evaluate(
    model, lossfunc, splits: Splits, batch_size: int, prep, info: DistInfo | None = None
) -> dict[str, float]:
    """Mean loss and accuracy on the train-eval, validation and test splits (eval mode).

    With ``info.active``, every rank evaluates a contiguous slice of each split and the sums are
    all-reduced (collective; every rank gets the same numbers).
    """
    if info is not None and info.active:
        return _evaluate_sharded(model, lossfunc, splits, batch_size, prep, info)
    model.eval()
    out = {}
    for key in ("train", "valid", "test"):
        split = splits.train_eval if key == "train" else getattr(splits, key)
        loss_sum, correct = split_sums(model, lossfunc, split, batch_size, prep)
        out[f"{key}_loss"] = loss_sum / len(split)
        out[f"{key}_acc"] = correct / len(split)
    model.train()
    return out


def _slice(split: Split, lo: int, hi: int) -> Split:
    return Split(split.x[lo:hi], split.y[lo:hi])


def _evaluate_sharded(model, lossfunc, splits, batch_size, prep, info) -> dict[str, float]:
    model.eval()
    keys, sums = ("train", "valid", "test"), []
    for key in keys:
        split = splits.train_eval if key == "train" else getattr(splits, key)
        n = len(split)
        part = _slice(
            split, n * info.rank // info.world_size, n * (info.rank + 1) // info.world_size
        )
        loss_sum, correct = split_sums(model, lossfunc, part, batch_size, prep)
        sums += [loss_sum, float(correct)]
    model.train()
    device = next(model.parameters()).device
    total = torch.tensor(sums, dtype=torch.float64, device=device)
    dist.all_reduce(total)
    out, total = {}, total.tolist()
    for i, key in enumerate(keys):
        n = len(splits.train_eval if key == "train" else getattr(splits, key))
        out[f"{key}_loss"] = total[2 * i] / n
        out[f"{key}_acc"] = total[2 * i + 1] / n
    return out
