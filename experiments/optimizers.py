"""The optimizers of the experiments: names, presets, extra options, construction.

An optimizer is named (``adam``, ``kfac``, ...); its keyword options come from a preset and from
explicit ``KEY=VALUE`` options (``--opt momentum=0.9``), explicit ones winning. Every keyword of
the optimizer's constructor is reachable except those the run fixes: ``params``, ``lr``,
``damping`` (its own field), ``curvature`` (part of the name), ``weight_decay`` (the problem's)
and ``process_group``.

Presets (curvature optimizers only; see docs/optim.md for the reasoning):

* ``paper``: the BackPACK paper's update: fresh curvature and inverses at every step, constant
  damping, no momentum, no trust region (``kl_clip=None``; the library's default is
  ``kl_clip=1e-3``), EKFAC's basis from each step's own factors (``basis_source="current"``;
  the library's default is the last refresh's). The paper's reproduction
  (``python -m experiments reproduce``) uses it.
* ``practical``: amortised curvature and inverses (every 10 steps), an exponential average of
  the curvature (0.95), heavy-ball momentum 0.9 and KL clipping (1e-3), as kfac-pytorch and
  K-FAC JAX configure K-FAC for speed.
* ``schedule_free`` (``KFAC``; the optimizer ``sf_kfac`` of the time-to-result grids):
  ``practical``'s amortisation and trust region with schedule-free averaging (β 0.9) in place of
  momentum (``curvopt.optim.stages.schedule_free``);
  it is evaluated at its average (``opt.eval()``), and runs with a warm-up and no decay, as
  schedule-free AdamW.

A damped optimizer's option ``reduction_scaled=True`` makes its ``damping`` (and its ``kl_clip``)
a value per unit of the loss's reduction scale ``s``: ``damping=ReductionScaledDamping(λ)``,
``λ s`` and ``κ s`` in the optimizer (``curvopt.inversion.damping``), so one value serves a
loss averaged over samples (``s = 1``) and one averaged over the pixels of each (``s = 1/P``).

``eigen_adam`` (``curvopt.optim.EigenAdam``: Adam's moments in the eigenbasis of KFAC's
Monte-Carlo Kronecker factors, SOAP-like) takes Adam's learning rates and no damping: it is not
in :data:`DAMPED` and no preset applies to it; its options (``basis_interval``, ``betas``, ...)
are explicit.

The peers from other packages (``soap``, ``psgd_kron``, ``sf_adamw``, ``muon_adamw``,
``klsoap``) and torch's Muon with AdamW (``muon``) are built by :mod:`experiments.peers`.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from .peers import PEERS, build_peer, peer_class
from .problem import Problem


class SetupError(RuntimeError):
    """A run cannot start: its optimizer or device is not available."""


#: name -> (class in ``curvopt.optim`` or None for torch.optim, fixed keyword arguments)
OPTIMIZERS: dict[str, tuple[str | None, dict]] = {
    "momentum": (None, {"momentum": 0.9}),
    "adam": (None, {}),
    "diagggn": ("DiagGGNNewton", {"curvature": "exact"}),
    "diagggn_mc": ("DiagGGNNewton", {"curvature": "mc"}),
    "kfac": ("KFAC", {"curvature": "kfac"}),
    "kflr": ("KFAC", {"curvature": "kflr"}),
    "kfra": ("KFAC", {"curvature": "kfra"}),
    "ekfac": ("EKFAC", {"curvature": "kfac"}),
    "sf_kfac": ("KFAC", {"curvature": "kfac"}),  # with the schedule_free preset
    # KFAC's direction orthogonalised (Newton-Schulz, as Muon) before the learning rate
    "kfac_ns": ("KFAC", {"curvature": "kfac", "orthogonalize": True}),
    # Adam in the eigenbasis of KFAC's (Monte-Carlo) factors; no damping, no preset
    "eigen_adam": ("EigenAdam", {"curvature": "kfac"}),
    "vsgd": ("VarianceAdaptedSGD", {}),
    **{name: (None, {}) for name in PEERS},
}
DAMPED = {"diagggn", "diagggn_mc", "kfac", "kflr", "kfra", "ekfac", "sf_kfac", "kfac_ns"}

#: Keywords a run fixes itself (not settable as options).
FIXED_KEYWORDS = {"self", "params", "lr", "damping", "curvature", "weight_decay", "process_group"}

#: the paper's update: no trust region (the constructors' default is ``kl_clip=1e-3``), the
#: curvature at every step (the constructors' default without a damping is every 10 steps)
_PAPER = {"kl_clip": None, "curvature_interval": 1}
_AMORTISED = {"curvature_interval": 10, "curvature_ema": 0.95, "momentum": 0.9, "kl_clip": 1e-3}

#: preset -> class name -> options (a class missing from a preset gets no options)
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "paper": {
        "DiagGGNNewton": dict(_PAPER),
        "KFAC": dict(_PAPER),
        # the paper's basis: this step's own factors (the default is the last refresh's)
        "EKFAC": {**_PAPER, "basis_source": "current"},
    },
    "practical": {
        "DiagGGNNewton": dict(_AMORTISED),
        "KFAC": {**_AMORTISED, "inverse_interval": 10},
        # eigenvalues corrected every step (no EMA): only the basis is amortised
        "EKFAC": {"basis_interval": 10, "momentum": 0.9, "kl_clip": 1e-3},
    },
    "schedule_free": {
        "KFAC": {**_AMORTISED, "inverse_interval": 10, "momentum": 0.0, "schedule_free": 0.9},
    },
}


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """The class behind optimizer ``name``; ``SetupError`` if curvopt does not provide it.

    ``curvopt`` is imported here, at first use, so that the first-order baselines run without it.
    """
    if name in PEERS:
        try:
            return peer_class(name)
        except ImportError as err:
            raise SetupError(str(err)) from err
    cls_name = OPTIMIZERS[name][0]
    if cls_name is None:
        return torch.optim.SGD if name == "momentum" else torch.optim.Adam
    try:
        import curvopt.optim

        return getattr(curvopt.optim, cls_name)
    except (ImportError, AttributeError) as err:
        raise SetupError(
            f"optimizer {name!r} needs curvopt.optim.{cls_name}, which is not available: {err}"
        ) from err


#: the option of a damped optimizer that makes its damping per unit of the loss's reduction
#: scale (:func:`make_optimizer`; see the module doc)
REDUCTION_SCALED = "reduction_scaled"


def allowed_options(name: str) -> list[str]:
    """The constructor keywords of optimizer ``name`` that may be set as options (a damped
    one's also :data:`REDUCTION_SCALED`)."""
    params = set(inspect.signature(optimizer_class(name).__init__).parameters)
    if name == "muon":  # Muon's keywords, and the AdamW part's lr (experiments.peers)
        params.add("adamw_lr_ratio")
    if name in DAMPED:
        params.add(REDUCTION_SCALED)
    return sorted(k for k in params if k not in FIXED_KEYWORDS and k not in OPTIMIZERS[name][1])


def parse_value(text: str) -> Any:
    """``"0.9"`` -> 0.9, ``"10"`` -> 10, ``"none"`` -> None, ``"true"`` -> True, else the text."""
    low = text.strip().lower()
    if low in ("none", "null"):
        return None
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_options(items: list[str] | None) -> tuple[tuple[str, Any], ...]:
    """``["momentum=0.9", ...]`` as a sorted tuple of ``(key, value)`` pairs."""
    out = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"optimizer option {item!r} is not KEY=VALUE (e.g. momentum=0.9)")
        out[key.strip()] = parse_value(value)
    return tuple(sorted(out.items()))


def check_options(name: str, preset: str | None, options: tuple[tuple[str, Any], ...]) -> None:
    """Raise ``ValueError`` for an unknown preset or an option the optimizer does not take."""
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
        if OPTIMIZERS[name][0] not in PRESETS[preset]:
            raise ValueError(
                f"preset {preset!r} is for the curvature optimizers ({', '.join(sorted(DAMPED))}),"
                f" not {name}; leave --preset out"
            )
    allowed = allowed_options(name)
    for key, _ in options:
        if key not in allowed:
            raise ValueError(
                f"{name} has no option {key!r}; it takes {', '.join(allowed) or 'none'}"
            )


def resolve_options(name: str, preset: str | None, options) -> dict[str, Any]:
    """The preset's options of ``name`` overridden by the explicit ``options``."""
    base = PRESETS[preset].get(OPTIMIZERS[name][0], {}) if preset is not None else {}
    return {**base, **dict(options)}


def make_optimizer(
    cfg, problem: Problem, model: torch.nn.Module, lossfunc: torch.nn.Module
) -> tuple[torch.optim.Optimizer, bool]:
    """Build ``cfg``'s optimizer (a ``RunConfig``); for curvopt's also extend model and loss.

    Returns the optimizer and whether its backward pass must run inside ``opt.collect()``.
    """
    cls_name, fixed = OPTIMIZERS[cfg.optimizer]
    groups = problem.param_groups(model)
    cls = optimizer_class(cfg.optimizer)
    kwargs = {**fixed, **resolve_options(cfg.optimizer, cfg.preset, cfg.options)}
    if cfg.optimizer in PEERS:
        if cfg.optimizer == "muon":
            kwargs["model"] = model
        return build_peer(cfg.optimizer, groups, cfg.lr, **kwargs), False
    if cls_name is None:
        return cls(groups, lr=cfg.lr, **kwargs), False
    import curvopt

    if kwargs.pop(REDUCTION_SCALED, False):
        kwargs["damping"] = curvopt.optim.ReductionScaledDamping(cfg.damping)
    elif cfg.damping is not None:
        kwargs["damping"] = cfg.damping
    curvopt.extend(model)
    curvopt.extend(lossfunc)
    opt = cls(groups, lr=cfg.lr, **kwargs)
    if problem.weight_decay and "weight_decay" not in opt.defaults:
        raise SetupError(
            f"{cls_name} has no weight_decay; {problem.name} needs "
            f"{problem.weight_decay} on its weights"
        )
    return opt, True
