"""The peers of the curvature optimizers: what a user would pick instead, from other packages.

* ``soap``: heavyball's ``SOAP`` (Adam in Shampoo's eigenbasis; one-sided for dimensions over
  its ``max_precond_dim``), heavyball's defaults otherwise;
* ``psgd_kron``: heavyball's ``PSGDKron`` (a Kronecker-factored preconditioner fitted by PSGD);
* ``sf_adamw``: ``schedulefree.AdamWScheduleFree``. Its parameters hold the interpolation
  ``y`` while training; they must be switched to the averaged weights ``x`` for evaluation
  (``opt.eval()``) and back (``opt.train()``): :func:`averaged_weights`.

heavyball and schedulefree are optional: they are imported when a peer is built, and a missing
one raises ``ImportError`` naming the install line.

Compilation (heavyball compiles its own update kernels with ``torch.compile``, a process-wide
setting ``heavyball.utils.compile_mode``): each heavyball peer tries the modes of
:data:`COMPILE_MODES` in order on a throw-away copy of its parameters with random gradients
(:data:`PROBE_STEPS` steps), and keeps the first that compiles; ``None`` (eager) if none does.
Its steps then run under that mode. The probe's seconds (the compilation) are reported by
:func:`compile_info` and counted in a run's wall-clock, never in a cost per step. A mode that
failed for a class and the same parameter shapes is not tried again in the process (a failed
compilation is not cached by torch, and takes minutes). A peer of :data:`EAGER_ON_CPU` is not
compiled on the CPU at all: every mode is known to fail there, after minutes.
"""

from __future__ import annotations

import contextlib
import importlib
import time
import weakref
from dataclasses import asdict, dataclass
from typing import Any

import torch

#: name -> (package, class, install line)
PEERS: dict[str, tuple[str, str, str]] = {
    "soap": ("heavyball", "SOAP", "pip install heavyball==3.2.1"),
    "psgd_kron": ("heavyball", "PSGDKron", "pip install heavyball==3.2.1"),
    "sf_adamw": ("schedulefree", "AdamWScheduleFree", "pip install schedulefree==1.4.1"),
}
#: tried in order: heavyball's own mode, then inductor's default (PSGD-Kron's matmul templates
#: of max-autotune fail on the CPU build of torch 2.13), then eager
COMPILE_MODES = ("max-autotune-no-cudagraphs", "default")
PROBE_STEPS = 3
#: peer -> why it runs eager on the CPU (without trying a compile mode)
EAGER_ON_CPU = {
    "psgd_kron": "inductor fails on torch 2.13's CPU build in every mode (AssertionError, after "
    "about 4.5 minutes; experiments/results/ttr/logs/fmnist_2c2d_psgd_kron_compile.log)",
}


@dataclass
class CompileInfo:
    """How a peer runs: ``mode`` (``None``: eager), the probe's seconds, the modes that failed."""

    compiled: bool
    mode: str | None
    compile_s: float
    failures: dict[str, str]

    def as_dict(self) -> dict:
        return asdict(self)


_COMPILE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: (class name, mode, parameter shapes per group) -> the error, for the modes that failed
_FAILED: dict[tuple, str] = {}


def peer_class(name: str) -> type[torch.optim.Optimizer]:
    package, cls_name, install = PEERS[name]
    try:
        module = importlib.import_module(package)
    except ImportError as err:
        raise ImportError(f"optimizer {name!r} needs {package} ({install}): {err}") from err
    return getattr(module, cls_name)


def build_peer(name: str, groups: list[dict], lr: float, **options: Any) -> torch.optim.Optimizer:
    """The peer ``name`` on the param groups ``groups``, ready to step (schedule-free in its
    training mode; heavyball's under the first compile mode that works)."""
    cls = peer_class(name)
    if PEERS[name][0] != "heavyball":
        opt = cls(groups, lr=lr, **options)
        if hasattr(opt, "train"):
            opt.train()
        return opt
    on_cpu = all(p.device.type == "cpu" for g in groups for p in g["params"])
    if name in EAGER_ON_CPU and on_cpu:
        info = CompileInfo(False, None, 0.0, {m: EAGER_ON_CPU[name] for m in COMPILE_MODES})
    else:
        info = _probe(cls, groups, lr, options)
    opt = cls(groups, lr=lr, **options)
    _COMPILE[opt] = info
    step = opt.step

    def step_in_mode(*args, **kwargs):
        with _compile_mode(info.mode):
            return step(*args, **kwargs)

    opt.step = step_in_mode
    return opt


def compile_info(opt: torch.optim.Optimizer) -> dict | None:
    """The :class:`CompileInfo` of a heavyball peer as a dict; ``None`` for other optimizers."""
    info = _COMPILE.get(opt)
    return None if info is None else info.as_dict()


@contextlib.contextmanager
def _compile_mode(mode: str | None):
    utils = importlib.import_module("heavyball.utils")
    before = utils.compile_mode
    utils.compile_mode = mode
    try:
        yield
    finally:
        utils.compile_mode = before


def _probe(cls, groups: list[dict], lr: float, options: dict) -> CompileInfo:
    """Step a copy of the parameters with random gradients under each mode of
    :data:`COMPILE_MODES`; the first that runs is kept."""
    failures = {}
    start = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    shapes = tuple(tuple(tuple(p.shape) for p in g["params"]) for g in groups)
    for mode in COMPILE_MODES:
        known = (cls.__name__, mode, shapes)
        if known in _FAILED:
            failures[mode] = _FAILED[known]
            continue
        copies = [
            {**g, "params": [p.detach().clone().requires_grad_() for p in g["params"]]}
            for g in groups
        ]
        probe = cls(copies, lr=lr, **options)
        try:
            with _compile_mode(mode):
                for _ in range(PROBE_STEPS):
                    for g in copies:
                        for p in g["params"]:
                            p.grad = torch.randn(p.shape, generator=gen).to(p)
                    probe.step()
        except Exception as err:  # inductor raises many types; the message is recorded
            failures[mode] = _FAILED[known] = f"{type(err).__name__}: {str(err).strip()[:300]}"
            continue
        return CompileInfo(True, mode, time.perf_counter() - start, failures)
    return CompileInfo(False, None, time.perf_counter() - start, failures)


@contextlib.contextmanager
def averaged_weights(opt: torch.optim.Optimizer):
    """Evaluate with the weights the optimizer reports: schedule-free's average ``x``
    (``opt.eval()``, then ``opt.train()`` after); other optimizers' parameters as they are.

    The training parameters are restored exactly after ``opt.train()`` (its interpolation back
    from ``x`` rounds differently), so that evaluating changes nothing in the training."""
    if not (callable(getattr(opt, "eval", None)) and callable(getattr(opt, "train", None))):
        yield
        return
    params = [p for g in opt.param_groups for p in g["params"]]
    saved = [p.detach().clone() for p in params]
    opt.eval()
    try:
        yield
    finally:
        opt.train()
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)
