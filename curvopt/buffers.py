"""Reuse of large result tensors across backward passes.

A fresh ``[N, *p.shape]`` tensor of 100+ MB costs more in page faults than the backward pass
itself on a CPU. Like ``p.grad``, a per-sample result is therefore written into the tensor that
the previous pass left on the parameter, but only when nothing else can observe it: no other
Python reference and no view of its storage. Otherwise a new tensor is allocated, so results a
user kept are never overwritten.
"""

from __future__ import annotations

import sys
from typing import Optional

import torch

# references held while inspecting: the attribute dict, two local names, getrefcount's argument
_PRIVATE_REFS = 4
# storage references while inspecting: the tensor itself and the temporary storage object
_PRIVATE_STORAGE_REFS = 2


def _is_private(tensor: torch.Tensor) -> bool:
    storage_refs = torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)
    return sys.getrefcount(tensor) <= _PRIVATE_REFS and storage_refs <= _PRIVATE_STORAGE_REFS


def reusable_attribute(
    param: torch.Tensor, attr: str, shape: torch.Size, like: torch.Tensor
) -> Optional[torch.Tensor]:
    """``param.<attr>`` if it has ``shape`` and ``like``'s dtype/device and is private, else None."""
    old = param.__dict__.get(attr)
    if (
        isinstance(old, torch.Tensor)
        and old.shape == shape
        and old.dtype == like.dtype
        and old.device == like.device
        and old.is_contiguous()
        and _is_private(old)
    ):
        return old
    return None


def empty_result(param: torch.Tensor, attr: str, shape, like: torch.Tensor) -> torch.Tensor:
    """A tensor to write ``param.<attr>`` into: the previous one when private, else a new one."""
    shape = torch.Size(shape)
    old = reusable_attribute(param, attr, shape, like)
    if old is not None:
        return old
    return torch.empty(shape, dtype=like.dtype, device=like.device)
