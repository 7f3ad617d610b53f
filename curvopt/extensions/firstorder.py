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
    """Per-sample gradients: ``p.grad_batch``, shape ``[N, *p.shape]``, rows summing to ``p.grad``.

    Row ``n`` is ``g_n``, the part of the gradient of the loss *as the loss module computes it*
    that comes from sample ``n``, so that ``grad_batch.sum(0) == p.grad``. With
    ``reduction="sum"`` the row is sample ``n``'s own gradient ``∇ℓ_n``; with
    ``reduction="mean"`` it is ``∇ℓ_n / D``, ``D`` what the loss divides by (``N`` for an
    ``[N, C]`` cross-entropy input, ``N·K`` for ``MSELoss`` on ``[N, K]``, the counted rows of
    a flattened sequence). Multiply by ``D`` (or use ``reduction="sum"``) before clipping
    per-sample norms (DP-SGD). See ``docs/conventions.md``.

    Takes no arguments. Several backward passes in one ``collect`` concatenate
    their rows along the batch.

    Example:
        >>> import torch, curvopt
        >>> from curvopt import extensions as ext
        >>> _ = torch.manual_seed(0)
        >>> model = curvopt.extend(torch.nn.Sequential(torch.nn.Linear(3, 2)))
        >>> lossfunc = curvopt.extend(torch.nn.CrossEntropyLoss())  # reduction="mean"
        >>> X, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
        >>> with curvopt.collect(ext.BatchGrad()):
        ...     lossfunc(model(X), y).backward()
        >>> w = model[0].weight
        >>> w.grad_batch.shape
        torch.Size([4, 2, 3])
        >>> torch.allclose(w.grad_batch.sum(0), w.grad)
        True
        >>> loss_0 = torch.nn.functional.cross_entropy(model(X[:1]), y[:1])  # sample 0 alone
        >>> torch.allclose(4 * w.grad_batch[0], torch.autograd.grad(loss_0, w)[0])
        True
    """

    quantity = Quantity(
        "grad_batch",
        Kind.PER_SAMPLE,
        Combine.CONCATENATE,
        Producer.PER_SAMPLE_GRADIENTS,
        reference=lambda g: g,
    )


class BatchL2Grad(Extension):
    """Squared norm of each per-sample gradient: ``p.batch_l2``, shape ``[N]``.

    ``batch_l2[n] = ‖g_n‖²`` over the entries of ``p``, i.e.
    ``(grad_batch**2).flatten(1).sum(1)`` without forming ``grad_batch`` where a layer allows
    it. Scaling: ``‖∇ℓ_n‖²`` for ``reduction="sum"``, ``‖∇ℓ_n‖² / D²`` for ``"mean"`` (``D``
    the loss's divisor, as for :class:`BatchGrad`). The norm over all parameters is
    ``sum(p.batch_l2 for p in params).sqrt()``.

    Takes no arguments.

    Example:
        >>> import torch, curvopt
        >>> from curvopt import extensions as ext
        >>> _ = torch.manual_seed(0)
        >>> model = curvopt.extend(torch.nn.Sequential(torch.nn.Linear(3, 2)))
        >>> lossfunc = curvopt.extend(torch.nn.CrossEntropyLoss())  # reduction="mean"
        >>> X, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
        >>> with curvopt.collect(ext.BatchGrad(), ext.BatchL2Grad()):
        ...     lossfunc(model(X), y).backward()
        >>> w = model[0].weight
        >>> w.batch_l2.shape
        torch.Size([4])
        >>> torch.allclose(w.batch_l2, (w.grad_batch**2).flatten(1).sum(1))
        True
    """

    quantity = Quantity(
        "batch_l2",
        Kind.PER_SAMPLE,
        Combine.CONCATENATE,
        Producer.SQUARED_NORMS,
        reference=lambda g: g.flatten(1).pow(2).sum(1),
    )


class SumGradSquared(Extension):
    """Second moment of the per-sample gradients: ``p.sum_grad_squared``, shape ``p.shape``.

    ``sum_grad_squared = Σ_n g_n²`` (element-wise square), i.e. ``(grad_batch**2).sum(0)``.
    Scaling: ``Σ_n (∇ℓ_n)²`` for ``reduction="sum"``, divided by ``D²`` for ``"mean"``
    (``D`` the loss's divisor, as for :class:`BatchGrad`). It is the diagonal of the
    empirical Fisher ``Σ_n g_n g_nᵀ`` of the loss as computed. Micro-batches add.

    Takes no arguments.

    Example:
        >>> import torch, curvopt
        >>> from curvopt import extensions as ext
        >>> _ = torch.manual_seed(0)
        >>> model = curvopt.extend(torch.nn.Sequential(torch.nn.Linear(3, 2)))
        >>> lossfunc = curvopt.extend(torch.nn.CrossEntropyLoss())  # reduction="mean"
        >>> X, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
        >>> with curvopt.collect(ext.BatchGrad(), ext.SumGradSquared()):
        ...     lossfunc(model(X), y).backward()
        >>> w = model[0].weight
        >>> w.sum_grad_squared.shape
        torch.Size([2, 3])
        >>> torch.allclose(w.sum_grad_squared, (w.grad_batch**2).sum(0))
        True
    """

    quantity = Quantity(
        "sum_grad_squared",
        Kind.SUMMED,
        Combine.ADD,
        Producer.SUM_OF_SQUARES,
        reference=lambda g: g.pow(2).sum(0),
    )


class Variance(Extension):
    """Element-wise variance of the per-sample gradients: ``p.variance``, shape ``p.shape``.

    ``variance = mean_n g_n² − (mean_n g_n)²``, the population variance of the rows of
    ``grad_batch``: ``(grad_batch**2).mean(0) - grad_batch.mean(0)**2``. Scaling: the
    variance of ``∇ℓ_n`` for ``reduction="sum"``, of ``∇ℓ_n / D`` (so divided by ``D²``) for
    ``"mean"``. Micro-batches in one ``collect`` give the variance over all samples seen.

    Takes no arguments.

    Example:
        >>> import torch, curvopt
        >>> from curvopt import extensions as ext
        >>> _ = torch.manual_seed(0)
        >>> model = curvopt.extend(torch.nn.Sequential(torch.nn.Linear(3, 2)))
        >>> lossfunc = curvopt.extend(torch.nn.CrossEntropyLoss())  # reduction="mean"
        >>> X, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
        >>> with curvopt.collect(ext.BatchGrad(), ext.Variance()):
        ...     lossfunc(model(X), y).backward()
        >>> w = model[0].weight
        >>> g = w.grad_batch
        >>> torch.allclose(w.variance, (g**2).mean(0) - g.mean(0) ** 2, atol=1e-7)
        True
    """

    quantity = Quantity(
        "variance",
        Kind.MOMENT,
        Combine.MOMENTS,
        Producer.MOMENTS,
        reference=lambda g: g.pow(2).mean(0) - g.mean(0).pow(2),
    )


FIRST_ORDER = (BatchGrad, BatchL2Grad, SumGradSquared, Variance)
