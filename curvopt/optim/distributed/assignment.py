"""Work assignment: which rank computes which derived quantity (pure, no communication)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass
class Job:
    """A quantity derived from a parameter's curvature, to compute on one rank."""

    description: str  # "parameter 'name' (shape ...)", for errors
    compute: Callable[[], Any]  # the value (tensors in nested lists/tuples)
    empty: Callable[[], Any]  # uninitialised tensors of the value's structure (to receive it)
    cost: float


def assign_owners(costs: Sequence[float], ranks: int) -> list[int]:
    """The rank computing each job: greedy longest-processing-time balance of ``costs``.

    Jobs are taken from the most to the least expensive (ties: lower index first) and given to
    the rank with the least load so far (ties: lower rank). Deterministic, so every rank computes
    the same assignment.
    """
    loads = [0.0] * ranks
    owners = [0] * len(costs)
    for job in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(ranks), key=lambda r: (loads[r], r))
        owners[job] = rank
        loads[rank] += costs[job]
    return owners


def inversion_cost(curvature) -> float:
    """``Σ dim³`` over Kronecker factors (``G dim³`` for factors stacked per group, ``numel``
    for a diagonal): cost of inverting it."""
    if isinstance(curvature, torch.Tensor):
        return float(curvature.numel())
    return float(sum(math.prod(f.shape[:-1]) * f.shape[-1] ** 2 for f in curvature))
