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


def probe_columns(x: torch.Tensor, spans: int = 16, width: int = 256) -> torch.Tensor:
    """``x [R, M]`` (contiguous rows) restricted to ``spans`` evenly spaced runs of ``width``
    columns, as a strided view ``[R, spans, width]`` (no copy), for cheap spot checks; ``x``
    itself (as ``[R, 1, M]``) when it has at most ``spans * width`` columns."""
    rows, numel = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    if numel <= spans * width:
        return x.unsqueeze(1)
    step = (numel - width) // (spans - 1)
    return x.as_strided((rows, spans, width), (x.stride(0), step, 1), x.storage_offset())
