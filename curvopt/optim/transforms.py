"""Small pure transforms of the stages and ``VarianceAdaptedSGD``; none modifies its inputs.
(The trust region's ``kl_clip_factor`` lives with its stage, ``stages.trust_region``.)

* :func:`ema` -- exponential moving average of curvature (tensors or factor lists; low-rank
  factors keep their Gram roots, stacked, and while narrow enough only them: ``GramFactor``).
* :func:`add_weight_decay` -- ``g + δ θ``.
* :func:`momentum` -- heavy-ball buffer ``v ← μ v + d``.
* :func:`orthogonalized` -- the polar factor ``U Vᵀ`` of a matrix ``U S Vᵀ``, approximately, by
  Newton–Schulz iterations (Muon's).
"""

from __future__ import annotations

from typing import Union

import torch

from curvopt.core.reductions import GramFactor, dense, gram_root
from curvopt.inversion.factor_inverse import root_alone

Curvature = Union[torch.Tensor, list[torch.Tensor]]


def ema(average: Curvature | None, new: Curvature, decay: float) -> Curvature:
    """The exponential moving average ``β · average + (1 − β) · new`` of a curvature.

    Element-wise, also over Kronecker factor lists (factors that carry Gram roots keep them).

    Args:
        average: the previous average, or ``None`` (none yet).
        new: the new curvature: a tensor or a list of factors.
        decay: ``β ∈ [0, 1)``.

    Returns:
        The average; ``new`` itself when ``average`` is ``None`` or ``β = 0``.

    Example:
        >>> import torch
        >>> from curvopt.optim import ema
        >>> ema(torch.tensor([1.0]), torch.tensor([3.0]), decay=0.75)
        tensor([1.5000])
    """
    if average is None or decay == 0:
        return new
    if isinstance(new, torch.Tensor):
        return torch.lerp(new, average, decay)
    return [_ema_factor(a, n, decay) for a, n in zip(average, new)]


def _ema_factor(average, new: torch.Tensor, decay: float):
    """``β F̄ + (1 − β) F`` of one Kronecker factor. When both carry Gram roots
    (``F̄ = ŪᵀŪ``, ``F = UᵀU``, see ``reductions.gram_root``) the average is the Gram of the
    stacked, weighted roots ``[√β Ū; √(1−β) U]``: while its Woodbury inverse is the cheaper one
    whatever the other side (``factor_inverse.root_alone``: at most half as many rows as the
    factor's size, and its eigendecomposition cheaper than the dense inverse) it is that root
    alone (a :class:`~curvopt.core.reductions.GramFactor`, no dense average formed); with fewer
    rows than the size, the dense average carries it, so that the optimizer can still invert it
    by Woodbury where that is cheaper."""
    roots = gram_root(average), gram_root(new)
    stacked = None
    if roots[0] is not None and roots[1] is not None:
        rows, dim = roots[0].shape[0] + roots[1].shape[0], new.shape[0]
        if rows < dim:
            stacked = torch.cat([roots[0] * decay**0.5, roots[1] * (1 - decay) ** 0.5])
            if root_alone(rows, dim):
                return GramFactor(stacked)
    result = torch.lerp(dense(new), dense(average), decay)
    if stacked is not None:
        result.gram_root = stacked
    return result


def add_weight_decay(grad: torch.Tensor, param: torch.Tensor, weight_decay: float) -> torch.Tensor:
    """The gradient with weight decay ``g + δ θ``: the gradient of ``L + δ/2 ‖θ‖²``.

    Args:
        grad: ``g``.
        param: ``θ``, of ``grad``'s shape.
        weight_decay: ``δ``.

    Returns:
        ``g + δ θ`` (``grad`` itself when ``δ = 0``); the inputs are not modified.

    Example:
        >>> import torch
        >>> from curvopt.optim import add_weight_decay
        >>> add_weight_decay(torch.tensor([1.0]), torch.tensor([2.0]), 0.5)
        tensor([2.])
    """
    if weight_decay == 0:
        return grad
    return grad.add(param, alpha=weight_decay)


def momentum(buffer: torch.Tensor | None, direction: torch.Tensor, mu: float) -> torch.Tensor:
    """The heavy-ball buffer ``v ← μ v + d``, with ``v = 0`` before the first step.

    Args:
        buffer: ``v``, or ``None`` before the first step.
        direction: ``d``.
        mu: ``μ``.

    Returns:
        The new ``v`` (``d`` itself when ``buffer`` is ``None`` or ``μ = 0``; otherwise
        a new tensor).

    Example:
        >>> import torch
        >>> from curvopt.optim import momentum
        >>> v = momentum(None, torch.tensor([1.0]), 0.9)
        >>> momentum(v.clone(), torch.tensor([1.0]), 0.9)
        tensor([1.9000])
    """
    if buffer is None or mu == 0:
        return direction
    return buffer.mul(mu).add_(direction)


#: the quintic Newton–Schulz iteration's coefficients ``(a, b, c)`` (Jordan et al. 2024, Muon):
#: chosen for the slope at zero, so five steps take every singular value of a normalised matrix
#: to about ``[0.7, 1.2]`` rather than exactly to 1
NEWTON_SCHULZ = (3.4445, -4.7750, 2.0315)


def orthogonalized(
    matrix: torch.Tensor, steps: int = 5, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``U f(S) Vᵀ`` for ``matrix = U S Vᵀ``: its polar factor ``U Vᵀ``, approximately.

    ``X ← M / ‖M‖_F``, then ``steps`` times ``X ← a X + (b XXᵀ + c (XXᵀ)²) X`` with
    :data:`NEWTON_SCHULZ` (on ``Mᵀ`` when ``M`` is taller than wide, so that ``XXᵀ`` is the
    smaller Gram matrix). Each singular value ``s`` goes through the scalar map
    ``σ ← a σ + b σ³ + c σ⁵`` from ``s / ‖M‖_F``; the singular vectors stay.

    Args:
        matrix: ``[rows, cols]``.
        steps: the number of iterations.
        dtype: the dtype the iterations compute in (``None``: ``matrix``'s).
            ``torch.optim.Muon`` computes in ``torch.bfloat16``: on hardware with bfloat16
            matrix units that is several times faster, and its rounding (relative ``2⁻⁸``)
            stays in the result.

    Returns:
        A new ``[rows, cols]`` tensor of ``matrix``'s dtype.

    Example:
        >>> import torch
        >>> from curvopt.optim import orthogonalized
        >>> o = orthogonalized(torch.diag(torch.tensor([3.0, 1.0])).double())
        >>> bool(((o.diagonal() > 0.6) & (o.diagonal() < 1.3)).all())
        True
    """
    a, b, c = NEWTON_SCHULZ
    x = matrix / matrix.norm().clamp_min(torch.finfo(matrix.dtype).tiny)
    if dtype is not None:
        x = x.to(dtype)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.mT
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + torch.addmm(gram, gram, gram, beta=b, alpha=c) @ x
    return (x.mT if tall else x).to(matrix.dtype)
