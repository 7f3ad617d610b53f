"""Reuse of large result tensors across backward passes.

A fresh ``[N, *p.shape]`` tensor of 100+ MB costs more in page faults than the backward pass
itself on a CPU. Like ``p.grad``, a per-sample result is therefore written into the tensor that
the previous pass left on the parameter, but only when nothing else can observe it: no other
Python reference and no view of its storage. Otherwise a new tensor is allocated, so results a
user kept are never overwritten.

A reused tensor is taken off the parameter while it is being overwritten: the pass puts it back
when it has finished, and a pass that fails half-way (for whatever reason: an unsupported
module, an exception in a user's tensor hook, an interrupt) leaves the attribute absent rather
than half-written.
"""

from __future__ import annotations

import sys
from typing import Optional

import torch

from curvopt.autograd.torch_internals import storage_use_count


def _references(tensor: torch.Tensor):
    """``(Python refs of tensor, refs of its StorageImpl, Python refs of its storage object)``.

    A view, a ``.numpy()`` array or ``set_`` shares the StorageImpl; a kept
    ``untyped_storage()`` object does not add a StorageImpl reference (the Python storage object
    is cached on it) but is itself referenced once more.
    """
    storage = tensor.untyped_storage()
    storage_refs = storage_use_count(storage)
    return sys.getrefcount(tensor), storage_refs, sys.getrefcount(storage)


def _calibrate():
    """The references of a tensor only a parameter's ``__dict__`` holds, inspected through the
    same call depth as :func:`reusable_attribute` uses (the counts depend on the Python and torch
    versions, so they are measured rather than hard-coded)."""
    param = torch.nn.Parameter(torch.empty(1))  # a throwaway of its own, never a user's
    param.__dict__["probe"] = torch.empty(1)
    old = param.__dict__.get("probe")
    return _probe(old)


def _probe(tensor: torch.Tensor):
    return _references(tensor)


def _is_private(tensor: torch.Tensor) -> bool:
    """No Python reference and no storage sharer besides ``param.__dict__``."""
    tensor_refs, storage_refs, storage_object_refs = _references(tensor)
    # (three comparisons written out: a generator over the pairs costs more than the reads)
    return (
        tensor_refs <= _PRIVATE[0]
        and storage_refs <= _PRIVATE[1]
        and storage_object_refs <= _PRIVATE[2]
    )


_PRIVATE = _calibrate()


def reusable_attribute(
    param: torch.Tensor, attr: str, shape: torch.Size, like: torch.Tensor
) -> Optional[torch.Tensor]:
    """``param.<attr>`` if it has ``shape``, ``like``'s dtype/device and is private, else None."""
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
    """A tensor to write ``param.<attr>`` into: the previous one when private (then removed from
    ``param`` until the pass writes it back), else a new one."""
    shape = torch.Size(shape)
    old = reusable_attribute(param, attr, shape, like)
    if old is not None:
        del param.__dict__[attr]
        return old
    return torch.empty(shape, dtype=like.dtype, device=like.device)
