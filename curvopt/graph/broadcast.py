"""Module calls without a batch dimension whose output is broadcast over the batch.

GPT-style models look up positions with one shared ``arange(T)`` and add them to every sample:
``tok(idx) + pos(arange(T))``; the output ``[T, D]`` (or ``[1, T, D]`` from position ids
``[1, T]``) of ``pos`` has no batch dim, and the gradient it receives is summed over samples.
The gradient of sample ``n`` is still visible one op downstream: for ``u = a + b`` with ``b``
broadcast, ``dL_n/db = reduce(dL_n/du)`` over the broadcast dims (likewise for
``b.expand(N, ...)``). A call is *broadcast* when its output reaches such an add or expand
through shape-only ops (unsqueeze, view, reshape); the engine then reads its per-sample
gradients (and propagated columns) at the add's output and treats the call as ``N`` calls on
the inputs repeated along a new leading batch dim.

Where the choice is made: the walk looks for broadcast calls only where it met a broadcasting
op (``walk.Walk.broadcasting``) and binds them on the pass's records (``Record.broadcast``,
their positions in the structure's key and plan); ``propagate.to_calls``, the records and the
backward pass's module hooks read the binding, nothing searches the graph again.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.autograd.graph import GradientEdge

from curvopt.autograd.torch_internals import (
    ADD,
    BROADCASTING_OPS,
    SHAPE_OPS,
    add_alpha,
    input_shape,
)


class Broadcast:
    """Where the per-sample gradients of a broadcast call's output can be read.

    ``edge`` is the gradient edge of the broadcasting op's output ``[N, *b]``; ``shape`` the
    call's output shape ``o``; ``leading`` whether ``o`` already has the batch dim (size 1).
    """

    def __init__(self, edge: GradientEdge, out_shape, operand_shape, full_shape):
        self.edge = edge
        self.out_shape = tuple(out_shape)
        self.samples = full_shape[0]
        pad = len(full_shape) - len(operand_shape)
        operand = (1,) * pad + tuple(operand_shape)
        #: dims (of the broadcast output, batch excluded) that the operand was broadcast along
        self.reduced = tuple(
            i for i in range(1, len(full_shape)) if operand[i] == 1 and full_shape[i] > 1
        )
        self.leading = len(self.out_shape) == len(full_shape) and self.out_shape[0] == 1

    @property
    def per_sample_shape(self):
        return self.out_shape[1:] if self.leading else self.out_shape

    def per_sample(self, columns: torch.Tensor) -> torch.Tensor:
        """``[k, N, *b] -> [k, N, *per_sample_shape]``: columns at the call's output, by sample."""
        if self.reduced:
            columns = columns.sum(tuple(1 + d for d in self.reduced), keepdim=True)
        return columns.reshape(columns.shape[0], self.samples, *self.per_sample_shape)

    def sample_grads(self, grad: torch.Tensor) -> torch.Tensor:
        """``[N, *b] -> [N, *per_sample_shape]``: the gradient at the op's output, by sample."""
        return self.per_sample(grad[None])[0]

    def repeat(self, x):
        """An input of the call repeated along the batch (``x [*s] -> [N, *s]`` or ``[1, *s]
        -> [N, *s]``); non-tensors unchanged."""
        if not isinstance(x, torch.Tensor):
            return x
        if self.leading:
            return x.expand(self.samples, *x.shape[1:])
        return x.unsqueeze(0).expand(self.samples, *x.shape)


def find(node, output_nr: int, out_shape, consumers) -> Optional[Broadcast]:
    """The :class:`Broadcast` of a call whose output is ``(node, output_nr)``, or None.

    ``consumers[(node, nr)]`` lists the ``(node, input index)`` pairs that take that output as
    an input (``walk.Walk.consumers``: read off the pass's walk, no graph walk here).
    """
    shape = tuple(out_shape)
    edge = (node, output_nr)
    while True:
        users = consumers.get(edge, [])
        if len(users) != 1:
            return None
        user = users[0][0]
        kind = type(user).__name__
        if kind not in BROADCASTING_OPS and kind not in SHAPE_OPS:
            return None
        full = input_shape(user, 0)
        if kind in BROADCASTING_OPS:
            operand = (1,) * (len(full) - len(shape)) + shape
            if len(shape) > len(full) or operand[0] != 1 or operand == full:
                return None  # the operand has a batch dim, or nothing is broadcast
            if kind == ADD and add_alpha(user) != 1.0:
                return None
            return Broadcast(GradientEdge(user, 0), out_shape, shape, full)
        shape = full
        edge = (user, 0)
