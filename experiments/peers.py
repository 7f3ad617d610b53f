"""The peers of the curvature optimizers: what a user would pick instead, from other packages.

* ``soap``: heavyball's ``SOAP`` (Adam in Shampoo's eigenbasis; one-sided for dimensions over
  its ``max_precond_dim``), heavyball's defaults otherwise;
* ``psgd_kron``: heavyball's ``PSGDKron`` (a Kronecker-factored preconditioner fitted by PSGD);
* ``sf_adamw``: ``schedulefree.AdamWScheduleFree``. Its parameters hold the interpolation
  ``y`` while training; they must be switched to the averaged weights ``x`` for evaluation
  (``opt.eval()``) and back (``opt.train()``): :func:`averaged_weights`;
* ``muon_adamw``: heavyball's ``MuonAdamW`` (Muon's orthogonalised Nesterov momentum on every
  parameter of 2 or more dimensions, conv filters flattened, AdamW on the rest; one lr for
  both), heavyball's defaults otherwise;
* ``klsoap``: heavyball's ``KLSOAP`` (SOAP with KL-Shampoo's two-sided factor update),
  heavyball's defaults otherwise;
* ``muon``: ``torch.optim.Muon`` with ``torch.optim.AdamW``, as torch's documentation
  prescribes: Muon takes 2-D parameters of hidden layers only, so it gets the weight of every
  ``nn.Linear`` but the model's last (the output layer: logits or reconstruction); AdamW gets
  the rest (biases, norms, embeddings, conv filters, raw tokens, the output layer), at
  ``adamw_lr_ratio`` (default 0.1) times Muon's lr, so that the grid's lr and schedule move
  both. Muon's defaults otherwise (momentum 0.95, Nesterov, 5 Newton-Schulz steps, the
  "original" lr adjustment ``sqrt(max(1, A / B))``), AdamW's too (betas 0.9, 0.999); weight
  decay the problem's (0 here) for both, not their defaults (0.1 and 0.01), as for every
  optimizer of the benchmark. One object (:class:`MuonWithAdamW`) steps and zeroes both.

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
    "muon_adamw": ("heavyball", "MuonAdamW", "pip install heavyball==3.2.1"),
    "klsoap": ("heavyball", "KLSOAP", "pip install heavyball==3.2.1"),
    "muon": ("torch.optim", "Muon", "torch >= 2.9"),
}
#: tried in order: heavyball's own mode, then inductor's default (PSGD-Kron's matmul templates
#: of max-autotune fail on the CPU build of torch 2.13), then eager
COMPILE_MODES = ("max-autotune-no-cudagraphs", "default")
PROBE_STEPS = 3
#: peer -> why it runs eager on the CPU (without trying a compile mode)
EAGER_ON_CPU = {
    "psgd_kron": "inductor fails on torch 2.13's CPU build in every mode (AssertionError, after "
    "about 4.5 minutes; experiments/results/ttr/logs/fmnist_2c2d_psgd_kron_compile.log)",
    "klsoap": "inductor fails on torch 2.13's CPU build in every mode (InductorError: "
    "AssertionError, after about 6.5 minutes on a 3-layer MLP; "
    "experiments/results/ttr/logs/klsoap_compile.log)",
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


def build_peer(
    name: str,
    groups: list[dict],
    lr: float,
    model: torch.nn.Module | None = None,
    **options: Any,
) -> torch.optim.Optimizer:
    """The peer ``name`` on the param groups ``groups``, ready to step (schedule-free in its
    training mode; heavyball's under the first compile mode that works). ``muon`` needs the
    ``model`` (which parameters are hidden layers' weights)."""
    cls = peer_class(name)
    if name == "muon":
        if model is None:
            raise ValueError("muon needs the model: which weights are hidden nn.Linear weights")
        return MuonWithAdamW(model, groups, lr, **options)
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


def hidden_linear_weights(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The weights of every ``nn.Linear`` of ``model`` but its last (in module order): the
    parameters torch's Muon documentation gives Muon."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    return [m.weight for m in linears[:-1] if m.weight.ndim == 2]


class MuonWithAdamW:
    """``torch.optim.Muon`` on the hidden ``nn.Linear`` weights and ``torch.optim.AdamW`` on
    every other parameter of ``groups``, as one optimizer: ``param_groups`` (Muon's, then
    AdamW's; each keeps its group's ``weight_decay``), ``step``, ``zero_grad``,
    ``state_dict``. The AdamW groups' lr is ``adamw_lr_ratio * lr``; a schedule that scales
    every group's lr by one factor scales both."""

    def __init__(
        self,
        model: torch.nn.Module,
        groups: list[dict],
        lr: float,
        adamw_lr_ratio: float = 0.1,
        **muon_options: Any,
    ):
        hidden = {id(p) for p in hidden_linear_weights(model)}
        muon_groups, adamw_groups = [], []
        for g in groups:
            rest = {k: v for k, v in g.items() if k != "params"}
            mine = [p for p in g["params"] if id(p) in hidden]
            others = [p for p in g["params"] if id(p) not in hidden]
            if mine:
                muon_groups.append({**rest, "params": mine})
            if others:
                adamw_groups.append({**rest, "params": others, "lr": adamw_lr_ratio * lr})
        if not muon_groups:
            raise ValueError("muon: the model has no hidden nn.Linear weight for Muon")
        self.muon = torch.optim.Muon(muon_groups, lr=lr, **muon_options)
        self.adamw = (
            torch.optim.AdamW(adamw_groups, lr=adamw_lr_ratio * lr) if adamw_groups else None
        )
        self.optimizers = [o for o in (self.muon, self.adamw) if o is not None]
        self.defaults = {"lr": lr, "adamw_lr_ratio": adamw_lr_ratio, **muon_options}

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> dict:
        return {p: s for o in self.optimizers for p, s in o.state.items()}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for o in self.optimizers:
            o.step()
        return loss

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw and self.adamw.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.muon.load_state_dict(state["muon"])
        if self.adamw is not None:
            self.adamw.load_state_dict(state["adamw"])


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
