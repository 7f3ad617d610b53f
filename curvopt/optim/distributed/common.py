"""What the parts of :mod:`curvopt.optim.distributed` share: the counters of the collectives
and the flattening of nested tensor values into flat buffers."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class CommStats:
    """Payload bytes and calls of the collectives (cumulative; :meth:`reset` to zero)."""

    allreduce_bytes: int = 0  # curvature averaging
    allreduce_calls: int = 0
    broadcast_bytes: int = 0  # inverses / eigendecompositions, total over owners
    broadcast_calls: int = 0
    control_bytes: int = 0  # presence checks, failure flags, loss changes (small)
    control_calls: int = 0
    wait_s: float = 0.0  # time blocked waiting for the asynchronous curvature all-reduces
    inversions: int = 0  # inverses / eigendecompositions computed on this rank
    inversion_s: float = 0.0  # ... and the time they took
    received: int = 0  # ... received from other ranks
    broadcast_wait_s: float = 0.0  # time blocked waiting for the other ranks' inverses

    def reset(self) -> None:
        for name, value in CommStats().__dict__.items():
            setattr(self, name, value)


def control(tensor: torch.Tensor, group, stats: CommStats, op=dist.ReduceOp.SUM) -> None:
    """A small synchronous all-reduce (presence checks, failure flags, scalars), counted."""
    dist.all_reduce(tensor, op=op, group=group)
    stats.control_calls += 1
    stats.control_bytes += nbytes(tensor)


def leaves(tree) -> list[torch.Tensor]:
    """The tensors of ``tree`` (a tensor, or tensors in nested lists/tuples), in order."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    return [leaf for item in tree for leaf in leaves(item)]


def rebuild(tree, new_leaves):
    """``tree``'s structure (tensors in nested lists/tuples) filled with ``new_leaves``; a list
    keeps its type and attributes (a typed value's sides, ``curvopt.core.values``)."""
    if isinstance(tree, torch.Tensor):
        return next(new_leaves)
    items = [rebuild(item, new_leaves) for item in tree]
    if isinstance(tree, list):
        result = copy.copy(tree)
        result[:] = items
        return result
    return type(tree)(items)


def by_kind(tensors: Sequence[torch.Tensor]) -> dict[tuple, list[int]]:
    """Indices of ``tensors`` by ``(dtype, device)``, in order: one flat buffer each."""
    groups: dict[tuple, list[int]] = {}
    for index, t in enumerate(tensors):
        groups.setdefault((t.dtype, t.device), []).append(index)
    return groups


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
