"""The layout of a loss's rows over the model's samples: which rows one propagated column holds.

A square-root factor ``S [K, R, *F]`` of the loss Hessian covers the ``R`` rows of the loss input.
``RowLayout`` maps each row to the one sample it depends on (``sample[r]``) and packs the rows
into slots whose rows reach distinct samples (``slot[r]``: the number of earlier rows of the same
sample); a column restricted to one slot never holds two rows of the same sample. The map is
verified, and kept in the structure's plan (``plans.Plan.layouts``), by ``engine.rows``; the pass
reads it where its columns are made (``engine.curvature``, ``engine.compress``,
``engine.hessian``, ``engine.kron_pass``).
"""

from __future__ import annotations

import torch


class RowLayout:
    """Rows ``[R]`` -> samples, and the slots that pack rows of distinct samples together."""

    def __init__(self, sample: torch.Tensor, samples: int, row_dims: int = 1):
        self.sample = sample  # [R] long, R = prod(shape[:row_dims])
        self.samples = samples
        self.row_dims = row_dims
        counts = torch.bincount(sample)
        self.num_slots = int(counts.max()) if counts.numel() else 1
        if self.num_slots == 1:
            self.slot = None
            return
        # slot of row r = number of earlier rows of the same sample
        order = torch.argsort(sample, stable=True)
        starts = torch.cumsum(counts, 0) - counts
        rank = torch.empty_like(sample)
        rank[order] = torch.arange(sample.numel(), device=sample.device) - starts[sample[order]]
        self.slot = rank

    @classmethod
    def singly(cls, rows: int, row_dims: int, device) -> "RowLayout":
        """Every one of ``rows`` rows in a slot of its own: a column holds one row. The exact
        columns of a coupled pass (``engine.curvature``), where every row reaches every sample."""
        return cls(torch.zeros(rows, dtype=torch.long, device=device), 1, row_dims)

    def masks(self, first: int, stop: int, dtype, device) -> torch.Tensor:
        """``[stop - first, R]``: 1 where row ``r`` is in slot ``s``."""
        slots = torch.arange(first, stop, device=device)
        return (self.slot.to(device)[None, :] == slots[:, None]).to(dtype)

    def pack(self, columns: torch.Tensor, first: int, stop: int) -> torch.Tensor:
        """``[k, R, *F] -> [k * (stop - first), R, *F]``: every column restricted to each slot."""
        if self.slot is None:
            return columns
        m = self.masks(first, stop, columns.dtype, columns.device)
        rows = columns.shape[1 : 1 + self.row_dims]
        m = m.reshape(1, m.shape[0], *rows, *([1] * (columns.dim() - 1 - self.row_dims)))
        return (columns.unsqueeze(1) * m).flatten(0, 1)

    def first(self, k: int, *tensors):
        """``tensors`` (the loss input and its target, rows along their first ``row_dims``)
        restricted to the rows of the first ``k`` samples, the rows flattened; one whose leading
        dims are not the rows (a broadcast target) as it is."""
        keep = self.sample < k
        dims = self.row_dims

        def rows(t):
            if not isinstance(t, torch.Tensor) or t.shape[:dims].numel() != keep.numel():
                return t
            return t.flatten(0, dims - 1)[keep.to(t.device)]

        return tuple(rows(t) for t in tensors)
