"""The quantities ``curvopt.collect`` computes (exact conventions: ``docs/conventions.md``)."""

from curvopt.extensions.base import Extension
from curvopt.extensions.firstorder import BatchGrad, BatchL2Grad, SumGradSquared, Variance
from curvopt.extensions.secondorder import (
    KFAC,
    KFLR,
    KFRA,
    BatchDiagGGNExact,
    BatchDiagGGNMC,
    BatchDiagHessian,
    DiagGGNExact,
    DiagGGNMC,
    DiagHessian,
)

__all__ = [
    "Extension",
    "BatchGrad",
    "BatchL2Grad",
    "SumGradSquared",
    "Variance",
    "DiagGGNExact",
    "BatchDiagGGNExact",
    "DiagGGNMC",
    "BatchDiagGGNMC",
    "DiagHessian",
    "BatchDiagHessian",
    "KFAC",
    "KFLR",
    "KFRA",
]
