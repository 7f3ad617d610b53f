"""The one timed training step of the experiments: forward, a check, backward, step.

``training`` (the loop of a run), ``ttr`` (time to result) and ``step_profile`` all train through
:func:`timed_step`, so that "a step" and its phases mean the same everywhere:

* ``forward_s``: ``opt.zero_grad()``, the forward pass and the loss;
* ``check_s``: the caller's decision whether the loss allows a backward pass (by default
  ``isfinite(loss)``; under ``torch.distributed`` an all-reduce of the batch's sums);
* ``backward_s``: ``loss.backward()``, inside ``opt.collect()`` for curvopt's optimizers (so it
  includes the curvature work);
* ``step_s``: ``opt.step()`` (for curvopt's optimizers: inverses and the preconditioned update).

:func:`interleaved` is the one scheme by which cost per step is measured (``ttr.cost``,
``models_cost``): blocks of steps on the same batches, round-robin between the entries.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, ContextManager

import torch

#: What ``opt.step()`` raises when the setting diverged: a curvature that cannot be inverted or
#: a non-finite step.
DIVERGED = (torch.linalg.LinAlgError, FloatingPointError)

PHASES = ("forward_s", "check_s", "backward_s", "step_s")


def backward(opt: torch.optim.Optimizer, loss: torch.Tensor, collects: bool) -> None:
    """``loss.backward()``, inside ``opt.collect()`` for the curvopt optimizers."""
    if collects:
        with opt.collect():
            loss.backward()
    else:
        loss.backward()


def finite_loss(loss: torch.Tensor, logits: torch.Tensor, y: torch.Tensor) -> bool:
    """The default check: the batch loss is finite."""
    return math.isfinite(loss.item())


@dataclass
class Step:
    """One step's outcome: the loss and logits of its forward pass, whether the setting
    diverged (check failed, or ``opt.step()`` raised :data:`DIVERGED`), the phases' seconds."""

    loss: torch.Tensor
    logits: torch.Tensor
    diverged: bool
    times: dict[str, float] = field(default_factory=dict)

    @property
    def total_s(self) -> float:
        return sum(self.times.values())


def timed_step(
    net: Callable,
    lossfunc: Callable,
    opt: torch.optim.Optimizer,
    collects: bool,
    x: torch.Tensor,
    y: torch.Tensor,
    clock: Callable[[], float],
    check: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], bool] = finite_loss,
) -> Step:
    """Train one step on ``(x, y)``, timing each phase with ``clock`` (see the module doc).

    When ``check`` fails, no backward pass and no step run; their phases are absent from
    ``times``. When ``opt.step()`` raises :data:`DIVERGED`, ``step_s`` is absent.
    """
    t0 = clock()
    opt.zero_grad()
    logits = net(x)
    loss = lossfunc(logits, y)
    t1 = clock()
    ok = check(loss, logits, y)
    t2 = clock()
    times = {"forward_s": t1 - t0, "check_s": t2 - t1}
    if not ok:
        return Step(loss, logits, True, times)
    backward(opt, loss, collects)
    t3 = clock()
    times["backward_s"] = t3 - t2
    try:
        opt.step()
    except DIVERGED:
        return Step(loss, logits, True, times)
    times["step_s"] = clock() - t3
    return Step(loss, logits, False, times)


@dataclass
class Rounds:
    """What :func:`interleaved` measured: per entry the ``(wall, cpu)`` seconds per step of each
    counted block (``samples``), why an entry stopped (``failed``), the order blocks ran in."""

    samples: dict[str, list[tuple[float, float]]]
    failed: dict[str, str]
    sequence: list[str]

    def median(self, name: str, which: int) -> float | None:
        """The median seconds per step of ``name`` (``which``: 0 wall-clock, 1 CPU time), or
        ``None`` where it failed."""
        if name in self.failed:
            return None
        return statistics.median(t[which] for t in self.samples[name])


def interleaved(
    names: list[str],
    run_block: Callable[[str, int], str | None],
    block: int,
    rounds: int,
    warmup: int,
    clock: Callable[[], float],
    label: str,
    log: Callable[[str], object],
    context: Callable[[str], ContextManager] = lambda name: contextlib.nullcontext(),
) -> Rounds:
    """``warmup + rounds`` rounds in which every entry of ``names`` runs one block of ``block``
    steps (``run_block(name, round)``: ``None``, or why the entry failed, which stops it), the
    first entry rotating each round so that no entry always follows the same one; a block is
    timed by ``clock`` and by CPU time inside ``context(name)``; the counted rounds are logged
    after ``label``."""
    samples: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    failed: dict[str, str] = {}
    sequence: list[str] = []
    for r in range(warmup + rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            if name in failed:
                continue
            with context(name):
                wall, cpu = clock(), time.process_time()
                why = run_block(name, r)
                wall, cpu = clock() - wall, time.process_time() - cpu
            if why is not None:
                failed[name] = why
            sequence.append(name)
            if r >= warmup and name not in failed:
                samples[name].append((wall / block, cpu / block))
        if r >= warmup:
            log(
                f"{label} round {r - warmup + 1}/{rounds} (ms/step, wall/cpu): "
                + ", ".join(
                    f"{n} {1e3 * samples[n][-1][0]:.1f}/{1e3 * samples[n][-1][1]:.1f}"
                    for n in names
                    if samples[n]
                )
            )
    return Rounds(samples, failed, sequence)
