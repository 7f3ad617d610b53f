"""The optimizers' keyword options, declared once: a frozen dataclass per optimizer, its fields
the hyper-parameters of one param group, each with its default and its check.

* :class:`CurvatureOptions` -- ``lr`` and ``weight_decay`` (every optimizer);
* :class:`NewtonOptions` -- the ~10 options ``DiagGGNNewton``, ``KFAC`` and ``EKFAC`` share
  (``damping``, ``mc_samples``, ``momentum``, ``curvature_ema``, ``curvature_interval``,
  ``kl_clip``, ``fallback``, ...); each optimizer's module subclasses it with its own
  ``curvature`` choices and extra options.

An options class is validated when it is made (``__post_init__``: each field's check, then
:meth:`CurvatureOptions.relations` across fields), so ``Options.of_group(group)`` validates a
param group. :func:`constructor` writes an optimizer's ``__init__`` from it: the signature
``(self, params, <POSITIONAL>, *, <the other keyword fields>[, process_group=None])``, which
``inspect.signature`` shows and which binds (and rejects) arguments as a hand-written one would.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Sequence
from numbers import Real
from typing import Any, Callable, ClassVar

import torch

from curvopt.inversion.damping import as_damping, damping_strategy

Check = Callable[[str, Any], None]


def check_number(
    name: str,
    value,
    low: float = 0.0,
    high: float = math.inf,
    *,
    open_high: bool = False,
    integer: bool = False,
) -> None:
    """Raise ``ValueError`` unless ``low <= value <= high`` (``< high`` if ``open_high``); the
    message names the type expected and the type given (``lr="0.05"``: a str)."""
    kind = int if integer else Real
    ok = isinstance(value, kind) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and low <= value and (value < high if open_high else value <= high)
    if not ok:
        bounds = [f">= {low}"]
        if open_high or high < math.inf:
            bounds.append(f"< {high}" if open_high else f"<= {high}")
        what = "an int" if integer else "a finite number (float or int)"
        raise ValueError(
            f"{name} must be {what} {' and '.join(bounds)}, got {value!r} of type "
            f"{type(value).__name__}"
        )


def check_choice(name: str, value, choices: Sequence) -> None:
    """Raise ``ValueError`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def number(low: float = 0.0, high: float = math.inf, **kinds) -> Check:
    """The check of a number in ``[low, high]`` (see :func:`check_number`)."""
    return lambda name, value: check_number(name, value, low, high, **kinds)


def choice(*choices) -> Check:
    """The check of one of ``choices``."""
    return lambda name, value: check_choice(name, value, choices)


def flag(name: str, value) -> None:
    """Raise ``ValueError`` unless ``value`` is ``True`` or ``False``."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


#: how an eigenbasis is refreshed after its first (exact) one (``basis_refresh``, ``EKFAC`` and
#: ``EigenAdam``): ``"eigh"``, a new eigendecomposition; ``"warm"``, one power step from the last
#: basis and a QR (``inversion.warm_eigh``, SOAP's)
BASIS_REFRESH = ("eigh", "warm")

#: the dtypes Newton–Schulz may compute in (``orthogonalize_dtype``), by name
NEWTON_SCHULZ_DTYPES = {
    name: getattr(torch, name) for name in ("bfloat16", "float16", "float32", "float64")
}


def newton_schulz_dtype(value) -> torch.dtype | None:
    """``orthogonalize_dtype``'s dtype: ``None``, one of :data:`NEWTON_SCHULZ_DTYPES` or its
    name (``"bfloat16"``, as in a config file)."""
    if value is None or value in NEWTON_SCHULZ_DTYPES.values():
        return value
    if isinstance(value, str) and value in NEWTON_SCHULZ_DTYPES:
        return NEWTON_SCHULZ_DTYPES[value]
    raise ValueError(
        f"orthogonalize_dtype must be None or one of {list(NEWTON_SCHULZ_DTYPES)} (as a "
        f"torch.dtype or its name), or 'auto', got {value!r}"
    )


def optional(check: Check) -> Check:
    """``check``, or nothing for ``None``."""
    return lambda name, value: None if value is None else check(name, value)


#: how Kronecker factors treat positions that share a weight (``extensions.KFAC(kfac_approx=)``)
KFAC_APPROX = ("expand", "reduce")

#: ``α`` of the Newton optimizers' (``KFAC``, ``EKFAC``, ``DiagGGNNewton``) damping when none
#: is given (``damping=None``, ``relative_damping=None``): ``λ = α · s``, ``s`` the factor by
#: which the loss's reduction scales one sample's curvature (``damping.ReductionScaledDamping``),
#: so the default follows the loss's scale, not the network's; the trust region
#: (``kl_clip=1e-3``, kfac-pytorch's default, bounding ``lr² gᵀd`` by ``κ s``) bounds the steps.
#: Chosen by measurement (``benchmarks/default_robustness.py``: six seeds on the four DeepOBS
#: networks; the swaps of ``tests/test_timm_models.py``, ``tests/test_models_people_train.py``;
#: ``docs/optim.md``)
DEFAULT_REDUCTION_DAMPING = 1e-2

#: ``fallback`` of the Kronecker optimizers (``KFAC``, ``EKFAC``): what a parameter without a
#: Kronecker factorisation gets (:mod:`curvopt.optim.fallback`); ``None`` raises
KRONECKER_FALLBACKS = (None, "sgd", "diagonal")


def _damping(name: str, value) -> None:
    if value is not None:  # None: the default (``relative_damping``, else reduction-scaled)
        as_damping(value)


#: ``orthogonalize_dtype="auto"``: the faster of these on the host, measured once per device and
#: shape class (``stages.orthogonalize``)
AUTO_DTYPE = "auto"


def _newton_schulz_dtype(name: str, value) -> None:
    if value != AUTO_DTYPE:
        newton_schulz_dtype(value)


def _interpolation(name: str, value) -> None:
    check_number(name, value, 0.0, 1.0, open_high=True)
    if value == 0:  # y = z: the average x could not be recovered from the parameters
        raise ValueError(f"{name} must be > 0 (and < 1), got {value!r}")


def option(default: Any = dataclasses.MISSING, check: Check | None = None, keyword: bool = True):
    """A field of an options class: its default (none: required), its check, and whether it
    is a constructor keyword (``keyword=False``: fixed at its default, e.g. EKFAC's
    ``curvature_ema=0``, but still a hyper-parameter of every param group)."""
    metadata = {"check": check, "keyword": keyword}
    return dataclasses.field(default=default, kw_only=True, metadata=metadata)


@dataclasses.dataclass(frozen=True)
class CurvatureOptions:
    """``lr ≥ 0`` and ``weight_decay δ ≥ 0`` (added to the gradient)."""

    #: the fields the constructor takes positionally (after ``params``), in this order
    POSITIONAL: ClassVar[tuple[str, ...]] = ("lr", "weight_decay")
    #: the Monte-Carlo ``curvature`` choice, which errors name as the fix (None: none)
    MONTE_CARLO: ClassVar[str | None] = None

    lr: float = option(check=number())
    weight_decay: float = option(0.0, number())

    def __post_init__(self):
        for field in dataclasses.fields(self):
            check = field.metadata["check"]
            if check is not None:
                check(field.name, getattr(self, field.name))
        self.relations()

    def relations(self) -> None:
        """Raise ``ValueError`` where valid fields do not fit together (default: none)."""

    @classmethod
    def of_group(cls, group: dict[str, Any]) -> "CurvatureOptions":
        """The (validated) options of a param group (its other keys are ignored)."""
        return cls(**{f.name: group[f.name] for f in dataclasses.fields(cls)})

    def as_defaults(self) -> dict[str, Any]:
        """The ``defaults`` dict of ``torch.optim.Optimizer`` (values as given, not copied)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclasses.dataclass(frozen=True)
class NewtonOptions(CurvatureOptions):
    """The options of the damped Newton optimizers (:mod:`curvopt.optim.newton`)."""

    POSITIONAL: ClassVar[tuple[str, ...]] = ("lr", "damping", "curvature", "weight_decay")

    #: ``λ``: None (the default: ``relative_damping`` times the curvatures' mean eigenvalue
    #: where that is a number, else ``DEFAULT_REDUCTION_DAMPING`` times the loss's reduction
    #: scale ``s``), a number (absolute), a callable of the step count or a strategy
    #: (``inversion.damping``)
    damping: Any = option(None, _damping)
    curvature: str = option()  # each optimizer declares its default and choices
    mc_samples: int = option(1, number(1, integer=True))
    momentum: float = option(0.0, number(0.0, 1.0, open_high=True))
    curvature_ema: float = option(0.0, number(0.0, 1.0, open_high=True))
    #: ``k``: the curvature every ``k`` steps; None: ``plan.refresh_interval``'s (10 or 1)
    curvature_interval: int | None = option(None, optional(number(1, integer=True)))
    #: ``α`` of a relative ``damping=None``: ``λ = α · m``, ``m`` the mean of the curvatures'
    #: ``tr(C)/dim(C)``; None: the damping follows the loss's reduction instead
    relative_damping: float | None = option(None, optional(number()))
    kl_clip: float | None = option(1e-3, optional(number()))
    fallback: str | None = option(None, choice(None, "sgd"))
    #: ``K``: Kronecker factors from the first ``K`` samples of each batch (``extensions.KFAC(
    #: samples=K)``; ``None``: the whole batch); curvatures without sub-batches raise
    curvature_samples: int | None = option(None, optional(number(1, integer=True)))
    #: ``β``: schedule-free averaging (``stages.schedule_free``; evaluate after ``opt.eval()``)
    schedule_free: float | None = option(None, optional(_interpolation))
    #: each matrix-shaped update replaced by its polar factor (``stages.orthogonalize``, Muon's)
    orthogonalize: bool = option(False, flag)
    #: the dtype its Newton–Schulz iterations compute in (``None``: the update's; Muon's is
    #: ``torch.bfloat16``; ``"auto"``: bfloat16 or float32, the faster on the host)
    orthogonalize_dtype: Any = option(None, _newton_schulz_dtype)

    def relations(self) -> None:
        strategy = damping_strategy(self.damping, self.relative_damping, DEFAULT_REDUCTION_DAMPING)
        if self.schedule_free is not None and strategy.adaptive:
            raise ValueError(
                "schedule_free does not combine with adaptive (Levenberg-Marquardt) damping, "
                "whose quadratic model predicts the Newton step, not the averaged one; use a "
                "constant or scheduled damping, or schedule_free=None"
            )


def constructor(
    options: type[CurvatureOptions], keywords: dict[str, Any], init: Callable
) -> Callable:
    """An optimizer's ``__init__(self, params, ...)`` taking the keyword fields of ``options``
    (``options.POSITIONAL`` first, positionally, the others keyword-only, those of the most
    derived options class first) and then ``keywords`` (name: default, keyword-only, not
    hyper-parameters: ``process_group``, ``collection``, ``stages``); it validates the options
    and calls ``init(self, params, defaults, **keywords)``. ``TypeError`` for missing or
    unknown arguments, as in Python."""
    fields = {f.name: f for f in dataclasses.fields(options) if f.metadata["keyword"]}

    def parameter(name: str, kind) -> inspect.Parameter:
        default = fields[name].default
        empty = default is dataclasses.MISSING
        return inspect.Parameter(name, kind, default=inspect.Parameter.empty if empty else default)

    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    params = [inspect.Parameter("self", positional), inspect.Parameter("params", positional)]
    params += [parameter(name, positional) for name in options.POSITIONAL]
    classes = [c for c in options.__mro__ if dataclasses.is_dataclass(c)]

    def introduced(name: str) -> int:  # the options class that declared the field first
        return max(i for i, c in enumerate(classes) if name in c.__dataclass_fields__)

    # keyword-only: an optimizer's own options first, then those it shares
    others = sorted((n for n in fields if n not in options.POSITIONAL), key=introduced)
    params += [parameter(name, inspect.Parameter.KEYWORD_ONLY) for name in others]
    keyword = inspect.Parameter.KEYWORD_ONLY
    params += [inspect.Parameter(name, keyword, default=d) for name, d in keywords.items()]
    signature = inspect.Signature(params)

    def __init__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        values = dict(bound.arguments)
        del values["self"]
        groups, extras = values.pop("params"), {name: values.pop(name) for name in keywords}
        init(self, groups, options(**values).as_defaults(), **extras)

    __init__.__signature__ = signature
    __init__.__doc__ = f"See the class docstring; options: :class:`{options.__qualname__}`."
    return __init__
