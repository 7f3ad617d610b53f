"""curvopt: per-sample gradients, curvature and curvature optimizers from one backward pass."""

from curvopt import errors, extensions, optim
from curvopt.collect import collect
from curvopt.hooks import extend

__all__ = ["extend", "collect", "extensions", "errors", "optim"]
__version__ = "0.1.0"
