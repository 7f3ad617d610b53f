"""curvopt: per-sample gradients, curvature and curvature optimizers from one backward pass.

The package is layered. Its folders (and top-level modules), bottom up; each imports only from
its own layer or the layers below, and no two folders import each other
(``tests/test_import_layers.py`` reads this list). Each folder's ``__init__`` is its map.

0. ``errors``, ``extensions``: the exceptions and their shared texts; each quantity's declaration
1. ``autograd``: what curvopt reads of torch's autograd internals, checked against torch
2. ``core``: the data a pass hands around: records, calls, parameters, reductions, values, plans
3. ``layers``, ``losses``: per-module math, one rule per layer family and per loss
4. ``graph``: the autograd graph upstream of a loss: its walk, checkpoints, pools, propagation
5. ``engine``: what a pass computes: rows, curvature, factors, diagonals, results, buffers
6. ``guards``: the checks that make a wrong number an exception
7. ``loop``: one backward pass, from the loss's hook to the written results
8. ``entry``: where a loss enters a pass: a loss module, a returned or a functional loss
9. ``frontend``: ``extend``, ``collect``, an optimizer's collection, ``verify``
10. ``inversion``: the damping-and-inversion layer: damped inverses of curvature, damping
11. ``optim``, ``linalg``: the consumers: optimizers and curvature operators
12. ``laplace``: Laplace approximations built on both
"""

from curvopt import errors, extensions, linalg, optim
from curvopt.frontend.collect import collect
from curvopt.frontend.hooks import extend, unextend
from curvopt.frontend.verify import VerificationError, verify

__all__ = [
    "extend",
    "unextend",
    "collect",
    "verify",
    "VerificationError",
    "extensions",
    "errors",
    "linalg",
    "optim",
]
__version__ = "0.1.0"
