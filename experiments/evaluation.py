"""Evaluation of a model on the splits, and the wall clock of the training loop."""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

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
def split_sums(
    model, lossfunc, split: Split, batch_size: int, prep, bar: tqdm | None = None
) -> tuple[float, int]:
    """``(sum of the per-sample losses, number correct)`` of ``model`` on ``split``; ``bar``
    advances by one per batch."""
    loss_sum, correct = 0.0, 0
    for x, y in eval_batches(split, batch_size, prep):
        logits = model(x)
        loss_sum += lossfunc(logits, y).item() * len(y)
        correct += (logits.argmax(1) == y).sum().item()
        if bar is not None:
            bar.update()
    return loss_sum, correct


def _bar(parts: list[Split], batch_size: int, label: str | None) -> tqdm:
    """Progress of an evaluation over ``parts`` (shown when ``label`` is given): batches done,
    and the time left."""
    return tqdm(
        total=sum(math.ceil(len(s) / batch_size) for s in parts),
        desc=label,
        unit="batch",
        leave=False,
        disable=label is None,
        dynamic_ncols=True,
    )


@torch.no_grad()
def evaluate(
    model,
    lossfunc,
    splits: Splits,
    batch_size: int,
    prep,
    info: DistInfo | None = None,
    progress: str | None = None,
) -> dict[str, float]:
    """Mean loss and accuracy on the train-eval, validation and test splits (eval mode), with a
    progress bar named ``progress`` when given.

    With ``info.active``, every rank evaluates a contiguous slice of each split and the sums are
    all-reduced (collective; every rank gets the same numbers).
    """
    if info is not None and info.active:
        return _evaluate_sharded(model, lossfunc, splits, batch_size, prep, info, progress)
    model.eval()
    out = {}
    parts = [splits.train_eval, splits.valid, splits.test]
    with _bar(parts, batch_size, progress) as bar:
        for key, split in zip(("train", "valid", "test"), parts):
            loss_sum, correct = split_sums(model, lossfunc, split, batch_size, prep, bar)
            out[f"{key}_loss"] = loss_sum / len(split)
            out[f"{key}_acc"] = correct / len(split)
    model.train()
    return out


def _slice(split: Split, lo: int, hi: int) -> Split:
    return Split(split.x[lo:hi], split.y[lo:hi])


def _evaluate_sharded(
    model, lossfunc, splits, batch_size, prep, info, progress
) -> dict[str, float]:
    model.eval()
    keys, sums = ("train", "valid", "test"), []
    parts = []
    for key in keys:
        split = splits.train_eval if key == "train" else getattr(splits, key)
        n = len(split)
        lo, hi = n * info.rank // info.world_size, n * (info.rank + 1) // info.world_size
        parts.append(_slice(split, lo, hi))
    with _bar(parts, batch_size, progress if info.main else None) as bar:
        for part in parts:
            loss_sum, correct = split_sums(model, lossfunc, part, batch_size, prep, bar)
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
