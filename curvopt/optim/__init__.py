"""Curvature optimizers and the damping-and-inversion layer they share.

Optimizers (``torch.optim.Optimizer`` subclasses): :class:`DiagGGNNewton`, :class:`KFAC`,
:class:`EKFAC`, :class:`EigenAdam`, :class:`VarianceAdaptedSGD`. Pure tensor functions, usable
on their own; those of the damping-and-inversion layer live in ``curvopt.inversion`` (its
``__init__`` maps them; ``curvopt.linalg`` shares them) and are re-exported here, their public
surface:

* damping strategies: :class:`ConstantDamping`, :class:`ScheduledDamping`,
  :class:`LevenbergMarquardt`, :class:`RelativeDamping`, :class:`ReductionScaledDamping`,
  :func:`as_damping`, :func:`reduction_ratio`;
* inversion: :func:`cholesky_factor`, :func:`cholesky_solve_right`, :func:`cholesky_inverse`,
  :func:`psd_eigh`, :func:`cached`;
* diagonal curvature: :func:`diag_precondition`, :func:`diag_quadratic`;
* Kronecker curvature: :func:`as_matrix`, :func:`kron_matmul`, :func:`kron_quadratic`,
  :func:`trace_norm_pi`, :func:`trace_norm_damped`, :func:`trace_norm_inverse`,
  :func:`trace_norm_cholesky`, :func:`kron_cholesky_solve`, :func:`trace_norm_solvers`,
  :func:`kron_solve`, :class:`LowRankInverse`,
  :func:`kron_eigh`, :func:`exact_damped_solve`;
* the stages' transforms (``optim.transforms``, ``optim.stages.trust_region``): :func:`ema`,
  :func:`add_weight_decay`, :func:`momentum`, :func:`orthogonalized`, :func:`kl_clip_factor`.

See ``docs/optim.md``.
"""

from curvopt.core.psd import psd_eigh
from curvopt.inversion.damping import (
    ConstantDamping,
    LevenbergMarquardt,
    ReductionScaledDamping,
    RelativeDamping,
    ScheduledDamping,
    as_damping,
    reduction_ratio,
)
from curvopt.inversion.diagonal import diag_precondition, diag_quadratic
from curvopt.inversion.factor_inverse import (
    LowRankInverse,
    cholesky_factor,
    cholesky_inverse,
    cholesky_solve_right,
)
from curvopt.inversion.kronecker import (
    as_matrix,
    exact_damped_solve,
    kron_eigh,
    kron_matmul,
    kron_quadratic,
)
from curvopt.inversion.trace_norm import (
    kron_cholesky_solve,
    kron_solve,
    trace_norm_cholesky,
    trace_norm_damped,
    trace_norm_inverse,
    trace_norm_pi,
    trace_norm_solvers,
)
from curvopt.optim.base import CurvatureOptimizer
from curvopt.optim.diag_ggn import DiagGGNNewton
from curvopt.optim.distributed import DistributedCurvature
from curvopt.optim.eigen_adam import EigenAdam
from curvopt.optim.ekfac import EKFAC
from curvopt.optim.kfac import KFAC
from curvopt.optim.newton import NewtonOptimizer
from curvopt.optim.plan import cached
from curvopt.optim.stages.trust_region import kl_clip_factor
from curvopt.optim.transforms import add_weight_decay, ema, momentum, orthogonalized
from curvopt.optim.variance import VarianceAdaptedSGD

__all__ = [
    "EKFAC",
    "KFAC",
    "ConstantDamping",
    "CurvatureOptimizer",
    "DiagGGNNewton",
    "DistributedCurvature",
    "EigenAdam",
    "LevenbergMarquardt",
    "LowRankInverse",
    "NewtonOptimizer",
    "ReductionScaledDamping",
    "RelativeDamping",
    "ScheduledDamping",
    "VarianceAdaptedSGD",
    "add_weight_decay",
    "as_damping",
    "as_matrix",
    "cached",
    "cholesky_factor",
    "cholesky_inverse",
    "cholesky_solve_right",
    "diag_precondition",
    "diag_quadratic",
    "ema",
    "exact_damped_solve",
    "kl_clip_factor",
    "kron_cholesky_solve",
    "kron_solve",
    "kron_eigh",
    "kron_matmul",
    "kron_quadratic",
    "momentum",
    "orthogonalized",
    "psd_eigh",
    "reduction_ratio",
    "trace_norm_cholesky",
    "trace_norm_solvers",
    "trace_norm_damped",
    "trace_norm_inverse",
    "trace_norm_pi",
]
