"""Curvature as ``scipy.sparse.linalg.LinearOperator``s, for comparing approximations.

* exact, by automatic differentiation: :class:`GGN`, :class:`Hessian`,
  :class:`EmpiricalFisher`, :class:`FisherMC`;
* curvopt's approximations, from ``collect``: :class:`Diagonal`, :class:`KFAC`, :class:`EKFAC`
  (with ``.inverse(damping, ...)``, what the optimizers apply);
* spectra and traces of any of them: :func:`top_eigenpairs`, :func:`hutchinson_trace`,
  :func:`hutchinson_diagonal`.

Conventions (parameter order, scaling over batches): ``docs/conventions.md``, "curvopt.linalg".
"""

from curvopt.linalg.base import CurvatureOperator
from curvopt.linalg.diagonal import Diagonal
from curvopt.linalg.ekfac import EKFAC
from curvopt.linalg.exact import GGN, EmpiricalFisher, FisherMC, Hessian
from curvopt.linalg.kronecker import KFAC
from curvopt.linalg.spectral import (
    Estimate,
    hutchinson_diagonal,
    hutchinson_trace,
    top_eigenpairs,
)

__all__ = [
    "EKFAC",
    "KFAC",
    "CurvatureOperator",
    "Diagonal",
    "Estimate",
    "EmpiricalFisher",
    "FisherMC",
    "GGN",
    "Hessian",
    "hutchinson_diagonal",
    "hutchinson_trace",
    "top_eigenpairs",
]
