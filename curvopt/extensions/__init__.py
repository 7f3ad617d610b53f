"""The quantities ``curvopt.collect`` computes (exact conventions: ``docs/conventions.md``)."""

from curvopt.extensions.base import Extension, extension, writer
from curvopt.extensions.quantity import Combine, Kind, Producer, Quantity, declare, quantity
from curvopt.extensions.firstorder import BatchGrad, BatchL2Grad, SumGradSquared, Variance
from curvopt.extensions.secondorder import (
    EKFAC,
    KFAC,
    KFLR,
    KFACEmpirical,
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
    "extension",
    "writer",
    "Quantity",
    "Kind",
    "Combine",
    "Producer",
    "declare",
    "quantity",
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
    "KFACEmpirical",
    "KFRA",
    "EKFAC",
]
