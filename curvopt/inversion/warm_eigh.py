"""A warm-started eigenbasis refresh: one step of subspace (power) iteration from the previous
basis, then a QR, in place of a new eigendecomposition (SOAP's refresh, Vyas et al. 2024,
Algorithm 4).

For a symmetric PSD factor ``F [d, d]`` and the basis ``Q₀ [d, d]`` (orthogonal) of the last
refresh::

    Y  = F Q₀                               one power step
    s₀ = diag(Q₀ᵀ Y)                        the eigenvalue estimates of the old basis
    Q R = Y Π                               Y's columns ordered by decreasing s₀, orthonormalised
                                            (Householder QR), signed so that diag(R) ≥ 0

``|diag R|``, the norms of the power step's columns orthogonal to the earlier ones, are the
eigenvalues of a converged basis (``F q = λ q``), and at rounding level (``d ε ‖F‖``) where a
column of ``Q`` is set by rounding: the null space of ``F`` (``optim.one_sided`` settles the
basis inside it, as for ``eigh``'s).

and, where wanted, the new basis's estimates ``s = diag(Qᵀ F Q)``
(:func:`eigenvalue_estimates`, one more product). Cost: one ``d × d`` product and one QR (about
``2 d³ + 8/3 d³`` flops); on one CPU thread 1.35 to 1.55 times faster than ``eigh``
(``benchmarks/refresh_cost.py``). ``Q`` is orthogonal to rounding
(Householder), whatever ``F``. It is exact where ``Q₀`` is: ``F Q₀ = Q₀ diag(s₀)`` gives
``Q = Q₀`` up to the order of its columns. For a fixed ``F`` with distinct eigenvalues
``λ₁ > … > λ_d``, repeated refreshes are subspace iteration: the span of the first ``i`` columns
converges to the top ``i`` eigenvectors' at the rate ``(λ_{i+1}/λ_i)ᵏ`` after ``k`` refreshes,
and the off-diagonal mass ``‖QᵀFQ − diag(s)‖_F`` with it. A factor that drifts slowly between
refreshes is tracked with an error of the order of its drift in one refresh.
"""

from __future__ import annotations

import torch

from curvopt.core.psd import working_dtype
from curvopt.core.reductions import dense


def power_step(factor, previous: torch.Tensor) -> torch.Tensor:
    """``Y = F Q₀`` in ``working_dtype`` (float32 for bfloat16/float16): the power step of
    :func:`warm_eigenbasis`, from which ``diag(Q₀ᵀ F Q₀) = Σ_i (Q₀ ⊙ Y)_ij`` (the old basis's
    eigenvalue estimates, which ``EKFAC``'s trust region reads) takes no second product.

    Args:
        factor: ``F``, ``[d, d]`` (dense or a ``GramFactor``; or ``[G, d, d]``).
        previous: ``Q₀``, ``[d, d]`` (``[G, d, d]``).

    Returns:
        ``[d, d]`` (``[G, d, d]``).

    Example:
        >>> import torch
        >>> power_step(torch.diag(torch.tensor([1.0, 3.0])), torch.eye(2))
        tensor([[1., 0.],
                [0., 3.]])
    """
    matrix = dense(factor)
    matrix = matrix.to(working_dtype(matrix.dtype))
    return matrix @ previous.to(matrix.dtype)


def warm_eigenbasis(
    factor, previous: torch.Tensor, power: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The eigenbasis of ``factor`` refreshed from ``previous`` by one power step and a QR.

    Args:
        factor: ``F``, symmetric PSD ``[d, d]`` (dense or a ``GramFactor``), or stacked per
            group ``[G, d, d]``; computed in ``working_dtype`` (float32 for bfloat16/float16).
        previous: ``Q₀``, an orthogonal ``[d, d]`` (``[G, d, d]``) basis, the last refresh's.
        power: ``F Q₀`` (:func:`power_step`) where formed already; None: formed here.

    Returns:
        ``(r, Q)``: ``r = |diag R|`` (``[d]``; ``[G, d]``), the eigenvalues of ``Q``'s columns
        where the basis has converged (free; the Rayleigh quotients are
        :func:`eigenvalue_estimates`), and ``Q``, orthogonal, ``[d, d]`` (``[G, d, d]``).

    Example:
        >>> import torch
        >>> F = torch.diag(torch.tensor([1.0, 3.0], dtype=torch.float64))
        >>> estimates, basis = warm_eigenbasis(F, torch.eye(2, dtype=torch.float64))
        >>> estimates, basis.abs()
        (tensor([3., 1.], dtype=torch.float64), tensor([[0., 1.],
                [1., 0.]], dtype=torch.float64))
    """
    power = power_step(factor, previous) if power is None else power
    previous = previous.to(power.dtype)
    order = (previous * power).sum(-2).argsort(dim=-1, descending=True, stable=True)
    basis, triangle = torch.linalg.qr(power.gather(-1, order.unsqueeze(-2).expand_as(power)))
    diagonal = triangle.diagonal(dim1=-2, dim2=-1)
    signs = torch.where(diagonal < 0, -1.0, 1.0).to(basis.dtype)
    return diagonal.abs(), basis * signs.unsqueeze(-2)


def eigenvalue_estimates(factor, basis: torch.Tensor) -> torch.Tensor:
    """``diag(Qᵀ F Q)``: the eigenvalues of ``F`` where ``Q`` is its eigenbasis, else the
    diagonal of ``F`` in that basis (``Σ_i Q_ij (F Q)_ij`` per column ``j``).

    Args:
        factor: ``F``, ``[d, d]`` (dense or a ``GramFactor``; or ``[G, d, d]``).
        basis: ``Q``, ``[d, d]`` (``[G, d, d]``).

    Returns:
        ``[d]`` (``[G, d]``).

    Example:
        >>> import torch
        >>> eigenvalue_estimates(torch.diag(torch.tensor([1.0, 3.0])), torch.eye(2))
        tensor([1., 3.])
    """
    matrix = dense(factor).to(basis.dtype)
    return (basis * (matrix @ basis)).sum(-2)
