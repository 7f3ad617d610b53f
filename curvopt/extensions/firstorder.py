"""First-order quantities: per-sample gradients ``g_n`` and what is reduced from them.

With ``G = [g_1, ..., g_N]`` (``[N, *p.shape]``, ``g_n`` scaled as the loss scales it):

* ``BatchGrad``       -> ``p.grad_batch``       = G
* ``BatchL2Grad``     -> ``p.batch_l2``         = ``||g_n||^2`` for each n, ``[N]``
* ``SumGradSquared``  -> ``p.sum_grad_squared`` = ``sum_n g_n**2``
* ``Variance``        -> ``p.variance``         = ``mean_n g_n**2 - (mean_n g_n)**2``
"""

from curvopt.extensions.base import Extension
from curvopt.extensions.quantity import Combine, Kind, Producer, Quantity


class BatchGrad(Extension):
    """Per-sample gradients ``p.grad_batch`` of shape ``[N, *p.shape]``; they sum to ``p.grad``."""

    quantity = Quantity(
        "grad_batch",
        Kind.PER_SAMPLE,
        Combine.CONCATENATE,
        Producer.PER_SAMPLE_GRADIENTS,
        reference=lambda g: g,
    )


class BatchL2Grad(Extension):
    """Squared L2 norm of each per-sample gradient, ``p.batch_l2`` of shape ``[N]``."""

    quantity = Quantity(
        "batch_l2",
        Kind.PER_SAMPLE,
        Combine.CONCATENATE,
        Producer.SQUARED_NORMS,
        reference=lambda g: g.flatten(1).pow(2).sum(1),
    )


class SumGradSquared(Extension):
    """Second moment ``p.sum_grad_squared = sum_n g_n**2`` (shape of ``p``)."""

    quantity = Quantity(
        "sum_grad_squared",
        Kind.SUMMED,
        Combine.ADD,
        Producer.SUM_OF_SQUARES,
        reference=lambda g: g.pow(2).sum(0),
    )


class Variance(Extension):
    """Gradient variance ``p.variance = mean_n g_n**2 - (mean_n g_n)**2`` (shape of ``p``)."""

    quantity = Quantity(
        "variance",
        Kind.MOMENT,
        Combine.MOMENTS,
        Producer.MOMENTS,
        reference=lambda g: g.pow(2).mean(0) - g.mean(0).pow(2),
    )


FIRST_ORDER = (BatchGrad, BatchL2Grad, SumGradSquared, Variance)
