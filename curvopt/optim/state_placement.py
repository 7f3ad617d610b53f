"""Loaded optimizer state put where its parameter is.

``torch.optim.Optimizer.load_state_dict`` moves the tensors of a parameter's state to the
parameter's device and, for a floating-point parameter, to its dtype; it leaves other objects
as they were saved. curvopt's state also holds two tensor-like values, a curvature average kept
as its Gram root (:class:`~curvopt.core.reductions.GramFactor`) and a cached Woodbury inverse
(:class:`~curvopt.inversion.factor_inverse.LowRankInverse`), beside plain tensors in the same
lists. :func:`placed` applies the same policy to them, so that a checkpoint saved on one device
or in one precision resumes on another with every part of a factor list alike.
"""

from __future__ import annotations

from typing import Any

import torch

from curvopt.core.reductions import GramFactor
from curvopt.inversion.factor_inverse import LowRankInverse

#: the state values that are not tensors but hold them (each has a tensor-like ``.to``)
TENSOR_LIKE = (GramFactor, LowRankInverse)


def placed(value: Any, param: torch.Tensor) -> Any:
    """``value`` (a parameter's state, nested dicts, lists and tuples) with each
    :data:`TENSOR_LIKE` entry moved to ``param``'s device, and to its dtype where ``param`` is
    floating point (``Optimizer.load_state_dict``'s policy for tensors); the rest as it is."""
    if isinstance(value, TENSOR_LIKE):
        dtype = param.dtype if param.is_floating_point() else None
        return value.to(device=param.device, dtype=dtype)
    if isinstance(value, dict):
        return {key: placed(entry, param) for key, entry in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(placed(entry, param) for entry in value)
    return value
