"""The cases of the overhead benchmark: quantities, default cases and targets (the problems are
:mod:`experiments.overhead.problems`).

* quantities ``QUANTITIES``: the plain baseline, "hooks only" (extended model, no ``collect``),
             every first- and second-order extension; more with :func:`register_quantity`
* cases      ``DEFAULT_CASES`` (and the slow ``EXTRA_CASES``): ``(problem, quantity)`` pairs;
             ``TARGETS``: the issues' goals for curvopt's ratio to the plain step
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from curvopt import extensions as ext

PLAIN = "plain"  # name of the baseline quantity: un-extended model, forward + backward


@dataclass(frozen=True)
class Quantity:
    """What a step computes. ``extensions`` are curvopt extension factories (empty: no collect)."""

    name: str
    label: str
    extensions: tuple[Callable[[], ext.Extension], ...] = ()
    order: int = 1
    extended: bool = True  # whether the model is ``curvopt.extend``-ed at all (False: baseline)
    #: a product ``G @ v`` with the exact GGN operator instead of a backward pass
    matvec: bool = False
    #: curvature of the parameters of Linear/Conv2d layers only (the others frozen), the
    #: parameters every Kronecker-factor library supports (a weight tied to an Embedding: frozen)
    linear_only: bool = False

    def attrs(self) -> tuple[str, ...]:
        return tuple(factory().attr for factory in self.extensions)


QUANTITIES: dict[str, Quantity] = {}


def register_quantity(quantity: Quantity) -> Quantity:
    QUANTITIES[quantity.name] = quantity
    return quantity


register_quantity(Quantity(PLAIN, "plain forward+backward", extended=False))
register_quantity(Quantity("hooks", "extended, no collect (hooks only)"))
FIRST_ORDER = (ext.BatchGrad, ext.BatchL2Grad, ext.SumGradSquared, ext.Variance)
for _cls in FIRST_ORDER:
    register_quantity(Quantity(_cls.__name__, _cls.__name__, (_cls,)))
register_quantity(Quantity("first_order", "all four first-order", FIRST_ORDER))
SECOND_ORDER = (
    ext.DiagGGNMC,
    ext.KFAC,
    ext.KFLR,
    ext.DiagGGNExact,
    ext.DiagHessian,
    ext.KFRA,
)
for _cls in SECOND_ORDER:
    register_quantity(Quantity(_cls.__name__, _cls.__name__, (_cls,), order=2))
for _cls in (ext.KFAC, ext.KFLR):
    register_quantity(
        Quantity(
            f"{_cls.__name__}_linear",
            f"{_cls.__name__}, Linear/Conv2d parameters only",
            (_cls,),
            order=2,
            linear_only=True,
        )
    )
register_quantity(Quantity("GGN_matvec", "exact GGN @ v (linalg.GGN)", order=2, matvec=True))

#: cases measured by default: (problem, quantity); the plain step is always measured too
DEFAULT_CASES: list[tuple[str, str]] = [
    (problem, quantity)
    for problem in ("3c3d", "mlp", "cnn", "transformer")
    for quantity in (
        "hooks",
        "BatchGrad",
        "BatchL2Grad",
        "SumGradSquared",
        "Variance",
        "first_order",
    )
] + [
    ("3c3d", "DiagGGNMC"),
    ("3c3d", "KFAC"),
    ("3c3d", "KFLR"),
    ("3c3d", "DiagGGNExact"),
    ("mlp", "KFRA"),
]
#: slow cases, measured only when asked for (``--problems 3c3d_sigmoid allcnnc``)
EXTRA_CASES: list[tuple[str, str]] = [
    ("3c3d_sigmoid", "DiagHessian"),
    ("allcnnc", "DiagGGNExact"),
]

#: the issue's targets for curvopt (ratio to plain forward+backward)
TARGETS: dict[tuple[str, str], float] = {
    ("3c3d", "hooks"): 1.03,
    ("3c3d", "BatchL2Grad"): 1.2,
    ("3c3d", "SumGradSquared"): 1.4,
    ("3c3d", "Variance"): 1.4,
    ("cnn", "BatchGrad"): 1.1,
    ("mlp", "BatchGrad"): 4.0,
    ("3c3d", "DiagGGNMC"): 1.8,
    ("3c3d", "KFAC"): 1.8,
    ("3c3d", "KFLR"): 3.4,
    ("3c3d", "DiagGGNExact"): 5.9,
    ("3c3d_sigmoid", "DiagHessian"): 180.0,
    ("mlp", "KFRA"): 5.0,
}


#: the BackPACK comparison of issue 11: DeepOBS networks, every second-order quantity and
#: per-sample gradients (``--cases backpack``; run at ``--batch 8 --threads 1`` and
#: ``--batch 64 --threads 2``). KFRA only on logreg: curvopt supports it for Linear chains, and
#: BackPACK's KFRA on a conv net propagates dense ``[C·H·W]²`` matrices (gigabytes on 2C2D)
BACKPACK_CASES: list[tuple[str, str]] = [
    (problem, quantity)
    for problem in ("logreg", "2c2d", "3c3d")
    for quantity in ("BatchGrad", "DiagGGNMC", "DiagGGNExact", "DiagHessian", "KFAC", "KFLR")
] + [("logreg", "KFRA")]

#: the curvlinops comparison of issue 22 (``--cases curvlinops``): Kronecker factors and GGN
#: matvecs on 2C2D and the GPT-style decoder; on the GPT, curvlinops' KFAC covers only the
#: Linear layers, so the ``*_linear`` quantities compare on those parameters
CURVLINOPS_CASES: list[tuple[str, str]] = [
    ("2c2d", "KFAC"),
    ("2c2d", "KFLR"),
    ("2c2d", "GGN_matvec"),
    ("gpt", "KFAC"),
    ("gpt", "KFAC_linear"),
    ("gpt", "KFLR_linear"),
    ("gpt", "GGN_matvec"),
]

#: cells where a competitor computes another quantity under the same name: its time is
#: reported, the head-to-head ratio is marked ``≠`` and left out of the geometric mean
DIFFERENT_DEFINITIONS: dict[tuple[str, str, str], str] = {
    ("gpt", "KFLR_linear", "curvlinops"): (
        "curvlinops' type-2 KFAC backpropagates the c-th column of every row's loss-Hessian "
        "root together (V backward passes), which pairs the columns of different rows "
        "wherever attention mixes positions; curvopt's KFLR is the exact per-row sum, the "
        "expectation of KFAC under sampled targets (T·min(V, d) columns per sample). The two "
        "agree on the layers above the attention (proj, fc, out) and differ on qkv "
        "(tests/test_overhead_curvlinops.py)"
    ),
}
