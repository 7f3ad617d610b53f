"""Diagonal curvature ``C = diag(c)``: damped preconditioning and the quadratic form."""

from __future__ import annotations

import torch


def diag_precondition(grad: torch.Tensor, curvature: torch.Tensor, damping: float) -> torch.Tensor:
    """The damped diagonal Newton direction ``(diag(c) + λ I)⁻¹ g = g / (c + λ)``, element-wise.

    Args:
        grad: the gradient ``g``.
        curvature: the diagonal ``c``, of ``grad``'s shape.
        damping: ``λ``.

    Returns:
        ``g / (c + λ)``, of ``grad``'s shape.

    Example:
        >>> import torch
        >>> from curvopt.optim import diag_precondition
        >>> diag_precondition(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 3.0]), 1.0)
        tensor([0.5000, 0.5000])
    """
    return grad / (curvature + damping)


def diag_quadratic(curvature: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """The quadratic form ``sᵀ diag(c) s = Σ c ⊙ s²`` of a step ``s``.

    Args:
        curvature: the diagonal ``c``.
        step: ``s``, of ``curvature``'s shape.

    Returns:
        A scalar tensor.

    Example:
        >>> import torch
        >>> from curvopt.optim import diag_quadratic
        >>> diag_quadratic(torch.tensor([1.0, 3.0]), torch.tensor([2.0, 1.0]))
        tensor(7.)
    """
    return (curvature * step * step).sum()
