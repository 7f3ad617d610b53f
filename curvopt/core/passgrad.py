"""A parameter's gradient of one backward pass, kept so that autograd can still take it over.

When ``p.grad`` is ``None``, autograd's ``AccumulateGrad`` makes the incoming gradient ``p.grad``
itself only if nothing else references that tensor; a reference kept by a hook makes it copy
the gradient instead (``new_empty_strided`` + ``copy_``: the whole gradient, every pass). So the
hooks of a pass keep, in that case, the gradient's storage and layout (:class:`Accumulating`),
which are no reference to the tensor, and read the gradient back as ``p.grad`` once the pass
has accumulated it: the very tensor the hook saw. Where ``p.grad`` is then another tensor (a
``torch.autograd.grad`` pass, which accumulates nothing; a later hook of the user's that
returned a new gradient; a copy to ``p``'s strides), the gradient is a view of the kept
storage: the values the hook saw, either way.

The incoming tensor itself is kept (autograd then copies it or not, as it would) where ``p.grad``
already holds a gradient (autograd adds into it in place: no copy either way), where ``p`` is
not a leaf, where the gradient is not a plain dense tensor (sparse, a ``DTensor``), where the
pass builds a graph (``create_graph=True``: autograd copies anyway), and where ``p`` has
post-accumulate-grad hooks (which may change ``p.grad`` in place before the pass reads it).
"""

from __future__ import annotations

from typing import Union

import torch


class Accumulating:
    """``p``'s gradient of this pass, left for autograd to accumulate into ``p.grad``: its
    storage, offset, shape, strides and dtype as the hook saw it (:func:`gradient` reads it)."""

    __slots__ = ("p", "storage", "ptr", "offset", "size", "stride", "dtype")

    def __init__(self, p: torch.Tensor, grad: torch.Tensor):
        self.p = p
        self.storage = grad.untyped_storage()
        self.ptr = grad.data_ptr()
        self.offset = grad.storage_offset()
        self.size = grad.shape
        self.stride = grad.stride()
        self.dtype = grad.dtype

    def tensor(self) -> torch.Tensor:
        """``p.grad`` where it is the tensor the hook saw, else a view of the kept storage."""
        grad = self.p.grad
        if (
            grad is not None
            and grad.data_ptr() == self.ptr  # (the kept storage: no other tensor has its address)
            and grad.dtype == self.dtype
            and grad.shape == self.size
            and grad.stride() == self.stride
        ):
            return grad
        view = torch.empty(0, dtype=self.dtype, device=self.storage.device)
        return view.set_(self.storage, self.offset, self.size, self.stride)


def held(p: torch.Tensor, grad: torch.Tensor) -> Union[torch.Tensor, Accumulating]:
    """What a hook of ``p`` keeps of the incoming gradient ``grad`` of a pass: the tensor, or
    an :class:`Accumulating` where autograd would otherwise copy it (see the module)."""
    if (
        p.grad is None
        and type(grad) is torch.Tensor
        and grad.layout is torch.strided
        and p.is_leaf
        and not torch.is_grad_enabled()
        and not p._post_accumulate_grad_hooks
    ):
        return Accumulating(p, grad)
    return grad


def gradient(kept: Union[torch.Tensor, Accumulating]) -> torch.Tensor:
    """The gradient that :func:`held` kept, as a tensor (read once the pass accumulated it)."""
    return kept if isinstance(kept, torch.Tensor) else kept.tensor()
