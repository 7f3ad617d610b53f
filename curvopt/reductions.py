"""Reductions over the leading (sample/column) dims of large tensors, without big temporaries.

``torch.linalg.vector_norm(x, dim=0)`` and ``(x * x).sum(0)`` are slow or allocate a copy of
``x`` for tensors of 100+ MB on a CPU; accumulating row by row reads ``x`` once.
"""

from __future__ import annotations

import torch

#: rows at least this large are accumulated one by one; smaller ones in one vectorised op
_ROW_LOOP = 1 << 14


def sum_of_squares(x: torch.Tensor, dims: int = 1) -> torch.Tensor:
    """``sum over the first `dims` dims of x**2``, shape ``x.shape[dims:]``."""
    rows = x.reshape(-1, *x.shape[dims:])
    if rows[0].numel() < _ROW_LOOP:
        return (rows * rows).sum(0)
    total = torch.zeros_like(rows[0])
    for row in rows:
        total.addcmul_(row, row)
    return total


def squared_norms(x: torch.Tensor) -> torch.Tensor:
    """``[N]``: ``||x_n||^2`` of every row of ``x`` (``[N, ...]``)."""
    return torch.linalg.vector_norm(x.reshape(x.shape[0], -1), dim=1).square_()


def probe_spans(numel: int, spans: int = 16, width: int = 256) -> list:
    """``(start, length)`` of evenly spread contiguous runs of flat indices covering at most
    ``spans * width`` entries (all of them for small tensors), for cheap spot checks."""
    if numel <= spans * width:
        return [(0, numel)]
    step = (numel - width) / (spans - 1)
    return [(round(i * step), width) for i in range(spans)]
