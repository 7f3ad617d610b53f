"""What the parts of :mod:`curvopt.optim.distributed` share: the counters of the collectives,
the flattening of nested tensor values into flat buffers, and the tensors of a typed value
(``curvopt.core.values``) that its rank average is made from (:func:`summands`)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from curvopt.core.values import EigenCorrected, KroneckerFactors


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
    alltoall_bytes: int = 0  # FSDP2: rows sent to their owners and directions' rows back
    alltoall_calls: int = 0

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


def summands(value) -> list[torch.Tensor]:
    """The tensors of ``value`` whose rank averages make its average (:func:`from_summands`).

    * ``EigenCorrected`` ``[S, *bases]``: ``S`` alone. It is a sum over samples
      (``c · Σ_n (Q_0ᵀ G_n Q_1)²``, ``c`` the loss's divisor) in bases every rank shares, so
      the average of the ranks' ``S`` over equal shards is the ``S`` of all their samples; the
      bases are the same on every rank and stay as they are.
    * ``KroneckerFactors`` with ``uses`` (a weight used by several calls: a tied embedding and
      head): each call's own factors. Their averages are the full batch's (as one call's
      factors), and the nearest Kronecker product is made again from them; the average of the
      ranks' products would not be the product of the full batch (it is not linear).
    * anything else: all its tensors (:func:`leaves`).
    """
    if isinstance(value, EigenCorrected):
        return [value.eigenvalues]
    uses = getattr(value, "uses", None)
    if isinstance(value, KroneckerFactors) and uses:
        return [t for use in uses.values() for t in summands(use)]
    return leaves(value)


def from_summands(value, new_summands):
    """``value`` made from the averages of its :func:`summands` (``new_summands``, an iterator
    over them in order): the same type, attributes and structure."""
    if isinstance(value, EigenCorrected):
        return value.replaced([next(new_summands), *value.bases])
    uses = getattr(value, "uses", None)
    if isinstance(value, KroneckerFactors) and uses:
        return KroneckerFactors.of_uses(
            {name: from_summands(use, new_summands) for name, use in uses.items()}
        )
    return rebuild(value, new_summands)


def by_kind(tensors: Sequence[torch.Tensor]) -> dict[tuple, list[int]]:
    """Indices of ``tensors`` by ``(dtype, device)``, in order: one flat buffer each."""
    groups: dict[tuple, list[int]] = {}
    for index, t in enumerate(tensors):
        groups.setdefault((t.dtype, t.device), []).append(index)
    return groups


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def state_nbytes(state) -> int:
    """Bytes of the tensors an optimizer's ``state`` (``opt.state``, or one parameter's) holds:
    nested dicts, lists, tuples and objects' attributes, each tensor counted once.

    Example::

        held = state_nbytes(opt.state)   # under FSDP2: this rank's part
    """
    seen: set[int] = set()

    def walk(value) -> int:
        if id(value) in seen:
            return 0
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            return nbytes(value)
        if isinstance(value, dict):
            return sum(walk(v) for v in value.values())
        if isinstance(value, (list, tuple)):
            return sum(walk(v) for v in value)
        return sum(walk(v) for v in getattr(value, "__dict__", {}).values())

    return walk(state)
