"""The quantities ``curvopt.collect`` computes (see ``API.md`` for their exact conventions)."""

from curvopt.extensions.base import Extension
from curvopt.extensions.firstorder import BatchGrad, BatchL2Grad, SumGradSquared, Variance

__all__ = ["Extension", "BatchGrad", "BatchL2Grad", "SumGradSquared", "Variance"]
