"""Owners under FSDP2: each sharded parameter's curvature is kept by one rank, its owner.

``fully_shard`` leaves rank ``r`` its chunk of every parameter's rows (dim ``s`` of the
shard, ``⌈d_s/K⌉`` entries per rank, the last ones shorter or empty). A Kronecker direction
``B⁻¹ G A⁻¹`` mixes all rows, so one rank, the parameter's owner, computes it on the whole
parameter and keeps the factors, their average and inverses; the others keep nothing of them.

* :func:`owners_of` -- the owner of each parameter: greedy longest-processing-time balance
  (:func:`~.assignment.assign_owners`) of ``Σ dim³`` over the Kronecker factors its shape
  implies (:func:`shape_cost`), from the shapes alone, so every rank and every step (and a
  resumed run) finds the same owners.
* :func:`to_owners` -- every rank's rows of a tensor per parameter sent to the owner, which
  assembles the whole tensor (the parameter and its gradient before a step).
* :func:`from_owners` -- each owner's whole tensor (a direction) cut into the ranks' rows,
  each rank receiving its own.

Both are one ``all_to_all_single`` per ``(dtype, device)``: a rank sends the rows the others
need and receives those it needs, ``(K−1)/K`` of its owned parameters' sizes at most, instead
of the whole parameter that an all-gather or a broadcast gives every rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from curvopt.optim.distributed.assignment import assign_owners
from curvopt.optim.distributed.common import CommStats, by_kind, nbytes

__all__ = ["extent", "from_owners", "owners_of", "rows_of", "shape_cost", "to_owners"]


def shape_cost(shape: Sequence[int]) -> float:
    """``Σ dim³`` of the Kronecker factors of a parameter of ``shape``: ``d_B = shape[0]`` and,
    for a weight ``[out, in, *k]``, ``d_A = in·∏k`` (a vector: ``d_B³`` alone)."""
    if len(shape) == 0:
        return 1.0
    rest = math.prod(shape[1:])
    return float(shape[0] ** 3 + (rest**3 if len(shape) > 1 else 0))


def owners_of(params: Sequence[torch.Tensor], world: int) -> list[int]:
    """The owning rank of each of ``params`` (balanced by :func:`shape_cost`)."""
    return assign_owners([shape_cost(p.shape) for p in params], world)


def extent(p, rank: int) -> tuple[int, int, int]:
    """``(dim, start, length)``: the entries of dim ``dim`` that rank ``rank``'s shard of the
    ``DTensor`` ``p`` covers (FSDP2's chunking: ``⌈d/K⌉`` each, from ``rank·⌈d/K⌉`` on)."""
    dim = p.placements[0].dim
    size, world = p.shape[dim], p.device_mesh.size()
    chunk = math.ceil(size / world)
    start = min(rank * chunk, size)
    return dim, start, min(chunk, size - start)


def rows_of(p, whole: torch.Tensor, rank: int) -> torch.Tensor:
    """The rows of ``whole`` (shaped like ``p``) that rank ``rank``'s shard covers (a view)."""
    dim, start, length = extent(p, rank)
    return whole.narrow(dim, start, length)


def _shard_shape(p, rank: int) -> list[int]:
    dim, _, length = extent(p, rank)
    shape = list(p.shape)
    shape[dim] = length
    return shape


def _exchange(send: list[list[torch.Tensor]], receive: list[int], like, group, stats):
    """One ``all_to_all_single``: ``send[s]`` (flat tensors, in order) to rank ``s``,
    ``receive[r]`` elements from rank ``r``; the received buffer split by source."""
    flat = [torch.cat(parts) if parts else like.new_empty(0) for parts in send]
    buffer = torch.cat(flat)
    out = like.new_empty(sum(receive))
    dist.all_to_all_single(out, buffer, receive, [t.numel() for t in flat], group=group)
    stats.alltoall_calls += 1
    stats.alltoall_bytes += nbytes(buffer)
    return out.split(receive)


def to_owners(
    local: Sequence[torch.Tensor], params, owners: Sequence[int], group, stats: CommStats
) -> list[torch.Tensor | None]:
    """Each rank's shard ``local[i]`` of a tensor shaped like ``params[i]`` sent to
    ``owners[i]``: the whole tensor there, ``None`` on the other ranks (a collective)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    out: list[torch.Tensor | None] = [None] * len(local)
    for indices in by_kind(local).values():
        mine = [i for i in indices if owners[i] == rank]
        send = [[local[i].reshape(-1) for i in indices if owners[i] == s] for s in range(world)]
        sizes = [[math.prod(_shard_shape(params[i], r)) for i in mine] for r in range(world)]
        parts = _exchange(send, [sum(s) for s in sizes], local[indices[0]], group, stats)
        pieces = [part.split(size) for part, size in zip(parts, sizes)]
        for k, i in enumerate(mine):
            chunks = [pieces[r][k].view(_shard_shape(params[i], r)) for r in range(world)]
            out[i] = torch.cat(chunks, dim=extent(params[i], rank)[0])
    return out


def from_owners(
    whole: Sequence[torch.Tensor | None],
    params,
    owners: Sequence[int],
    local: Sequence[torch.Tensor],
    group,
    stats: CommStats,
) -> list[torch.Tensor]:
    """The rank's rows of each whole tensor ``whole[i]`` (given on ``owners[i]``, ``None``
    elsewhere; shaped like ``params[i]``), new tensors shaped and typed like the rank's shard
    ``local[i]`` (a collective)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    out: list[torch.Tensor | None] = [None] * len(local)
    for indices in by_kind(local).values():
        mine = [i for i in indices if owners[i] == rank]
        send = [
            [rows_of(params[i], whole[i], s).to(local[i].dtype).reshape(-1) for i in mine]
            for s in range(world)
        ]
        theirs = [[i for i in indices if owners[i] == r] for r in range(world)]
        sizes = [[local[i].numel() for i in at] for at in theirs]
        parts = _exchange(send, [sum(s) for s in sizes], local[indices[0]], group, stats)
        for at, part, size in zip(theirs, parts, sizes):
            for i, piece in zip(at, part.split(size)):
                out[i] = piece.view(local[i].shape)
    return out
