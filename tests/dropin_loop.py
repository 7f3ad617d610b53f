"""The cases of the framework tests (``test_frameworks_*.py``) and the plain loop they are
compared with: a hand-written loop with the same optimizer (armed, no ``with`` block), the
same micro-batches with each loss divided by their number (as the frameworks do), the same
clipping, schedule and autocast / ``GradScaler``. ``test_dropin_collection.py`` checks that
this loop takes the steps of one batch where the objectives coincide.

The curvatures are deterministic (``KFAC``/``EKFAC`` on ``kflr``, the exact GGN diagonal):
a framework may draw from the global random generator between passes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import List, Optional, Tuple

import torch
from torch import nn

import curvopt
from curvopt.optim import EKFAC, KFAC, DiagGGNNewton, VarianceAdaptedSGD

DT = torch.float64

OPTIMIZERS = {
    "KFAC": lambda p: KFAC(p, lr=0.1, damping=0.1, curvature="kflr"),
    # the Hugging Face Trainer calls opt.train() before every step (schedule-free's API)
    "KFAC-schedule-free": lambda p: KFAC(p, 0.1, 0.1, "kflr", schedule_free=0.9),
    "EKFAC": lambda p: EKFAC(p, 0.1, 0.1, "kflr"),
    # Muon's orthogonalised steps after KFAC's, with momentum
    "KFAC-orthogonalize": lambda p: KFAC(p, 0.05, 0.1, "kflr", momentum=0.9, orthogonalize=True),
    "DiagGGNNewton": lambda p: DiagGGNNewton(p, lr=0.1, damping=0.1, curvature="exact"),
    "VarianceAdaptedSGD": lambda p: VarianceAdaptedSGD(p, lr=0.1),
}


@dataclass(frozen=True)
class Setting:
    """``sizes``: the micro-batches of each step; ``precision``: "64" (float64), "fp32", "bf16"
    or "fp16" (autocast casts float32 only: the model is float32 but for "64", and both runs
    compute the same ops in the same order)."""

    sizes: Tuple[int, ...]
    steps: int = 2
    clip: Optional[float] = None
    schedule: bool = False
    precision: str = "64"


SETTINGS = {
    "one_batch": Setting((8,)),
    "accumulate_2": Setting((4, 4)),
    "accumulate_4": Setting((2, 2, 2, 2)),
    "accumulate_2_unequal": Setting((5, 3)),
    "clip_schedule": Setting((4, 4), clip=0.05, schedule=True),
    "bf16": Setting((4, 4), precision="bf16"),
    "fp16": Setting((4, 4), precision="fp16"),
    "fp16_clip": Setting((8,), clip=0.05, precision="fp16"),
}


def on_cpu(setting: Setting) -> Setting:
    """What accelerate (and the Trainer through it) runs on CPU: fp16 without autocast or a
    GradScaler, i.e. float32 ("fp32")."""
    return replace(setting, precision="fp32") if setting.precision == "fp16" else setting


def dtype(setting: Setting) -> torch.dtype:
    return DT if setting.precision == "64" else torch.float32


def make_model(setting: Setting) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    return curvopt.extend(model.to(dtype(setting)))


def make_loss(functional: bool = False):
    """The extended ``CrossEntropyLoss``, or (``functional``) ``F.cross_entropy`` itself."""
    return nn.functional.cross_entropy if functional else curvopt.extend(nn.CrossEntropyLoss())


#: the settings the framework tests also run with a functional loss (``make_loss(True)``)
FUNCTIONAL_SETTINGS = ("accumulate_2_unequal", "clip_schedule", "bf16", "fp16")


def micro_batches(setting: Setting) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """All micro-batches, in order (``len(setting.sizes)`` per step)."""
    g = torch.Generator().manual_seed(0)
    dt = dtype(setting)
    return [
        (3 * torch.randn(n, 4, generator=g, dtype=dt), torch.randint(0, 3, (n,), generator=g))
        for _ in range(setting.steps)
        for n in setting.sizes
    ]


def schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 / (1 + step))


def autocast(setting: Setting):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(setting.precision)
    return torch.autocast("cpu", dtype=dtype, enabled=dtype is not None)


def parameters(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def plain_loop(name: str, setting: Setting, float_outputs: bool = False) -> torch.Tensor:
    """The parameters after the hand-written loop (``float_outputs``: the model's outputs
    cast to float32 under autocast, as accelerate's prepared model returns them)."""
    model, lossfunc = make_model(setting), make_loss()
    opt = OPTIMIZERS[name](model.parameters())
    sched = schedule(opt) if setting.schedule else None
    scaler = torch.amp.GradScaler("cpu") if setting.precision == "fp16" else None
    batches = iter(micro_batches(setting))
    k = len(setting.sizes)
    for _ in range(setting.steps):
        opt.zero_grad()
        for _ in range(k):
            X, y = next(batches)
            with autocast(setting):
                out = model(X)
                out = out.float() if float_outputs and setting.precision != "64" else out
                loss = lossfunc(out, y) / k
            (loss if scaler is None else scaler.scale(loss)).backward()
        if setting.clip is not None:
            if scaler is not None:
                scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), setting.clip)
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        if sched is not None:
            sched.step()
    return parameters(model)


def assert_same(got: torch.Tensor, want: torch.Tensor, setting: Setting) -> None:
    """≤ 1e-12 relative to the largest parameter, and the run moved the parameters."""
    scale = want.abs().max()
    error = float((got - want).abs().max() / scale)
    assert error <= 1e-12, f"relative difference {error:.2e}"
    start = parameters(make_model(setting))
    assert not torch.equal(want, start), "the case must move the parameters"


def readme_snippet(first_line: str) -> str:
    """The README's python block that starts with ``first_line``."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    (block,) = [b for b in blocks if b.startswith(first_line)]
    return block
