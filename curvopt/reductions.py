"""Reductions over the leading (sample/column) dims of large tensors, without big temporaries.

``torch.linalg.vector_norm(x, dim=0)`` and ``(x * x).sum(0)`` are slow or allocate a copy of
``x`` for tensors of 100+ MB on a CPU; accumulating row by row reads ``x`` once.
"""

from __future__ import annotations

import functools

from typing import Optional

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


@functools.lru_cache(maxsize=256)
def probe_index(numel: int, spans: int = 16, width: int = 256) -> Optional[torch.Tensor]:
    """Flat indices of ``spans`` evenly spread contiguous runs of ``width`` entries, for cheap
    spot checks; ``None`` when the tensor is small enough to check whole."""
    if numel <= spans * width:
        return None
    step = (numel - width) / (spans - 1)
    starts = torch.tensor([round(i * step) for i in range(spans)])
    return (starts[:, None] + torch.arange(width)).flatten()
