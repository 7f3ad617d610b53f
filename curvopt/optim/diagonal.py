"""Diagonal curvature ``C = diag(c)``: damped preconditioning and the quadratic form."""

from __future__ import annotations

import torch


def diag_precondition(grad: torch.Tensor, curvature: torch.Tensor, damping: float) -> torch.Tensor:
    """``(diag(c) + λ I)⁻¹ g = g / (c + λ)``, element-wise; all tensors of one shape."""
    return grad / (curvature + damping)


def diag_quadratic(curvature: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """``sᵀ diag(c) s = Σ c ⊙ s²``, a scalar tensor."""
    return (curvature * step * step).sum()
