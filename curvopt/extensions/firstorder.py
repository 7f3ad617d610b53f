"""First-order quantities: per-sample gradients ``g_n`` and what is reduced from them.

With ``G = [g_1, ..., g_N]`` (``[N, *p.shape]``, ``g_n`` scaled as the loss scales it):

* ``BatchGrad``       -> ``p.grad_batch``       = G
* ``BatchL2Grad``     -> ``p.batch_l2``         = ``||g_n||^2`` for each n, ``[N]``
* ``SumGradSquared``  -> ``p.sum_grad_squared`` = ``sum_n g_n**2``
* ``Variance``        -> ``p.variance``         = ``mean_n g_n**2 - (mean_n g_n)**2``
"""

from curvopt.extensions.base import Extension


class BatchGrad(Extension):
    """Per-sample gradients ``p.grad_batch`` of shape ``[N, *p.shape]``; they sum to ``p.grad``."""

    attr = "grad_batch"


class BatchL2Grad(Extension):
    """Squared L2 norm of each per-sample gradient, ``p.batch_l2`` of shape ``[N]``."""

    attr = "batch_l2"


class SumGradSquared(Extension):
    """Second moment ``p.sum_grad_squared = sum_n g_n**2`` (shape of ``p``)."""

    attr = "sum_grad_squared"


class Variance(Extension):
    """Gradient variance ``p.variance = mean_n g_n**2 - (mean_n g_n)**2`` (shape of ``p``)."""

    attr = "variance"


FIRST_ORDER = (BatchGrad, BatchL2Grad, SumGradSquared, Variance)
