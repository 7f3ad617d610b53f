"""curvopt: per-sample gradients, curvature and curvature optimizers from one backward pass."""

from curvopt import errors, extensions, linalg, optim
from curvopt.collect import collect
from curvopt.hooks import extend
from curvopt.verify import VerificationError, verify

__all__ = [
    "extend",
    "collect",
    "verify",
    "VerificationError",
    "extensions",
    "errors",
    "linalg",
    "optim",
]
__version__ = "0.1.0"
