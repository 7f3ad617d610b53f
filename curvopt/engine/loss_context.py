"""What the curvature of one extended loss hands the producers that walk on from it
(``hessian``'s residual terms, ``kfra``'s recursion): exactly what they read, and no more."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch


@dataclass(frozen=True)
class LossContext:
    """``output``: the loss's input (the root of the columns); ``walk``: the ``walk.Walk`` of
    its graph; ``batched``: columns may be propagated batched (every backward op of the walk has
    a ``vmap`` rule); ``exact_columns(chunk)``: the exact square-root factor of the loss
    Hessian (scaled by the loss's factor), packed by slot, in chunks of at most ``chunk``
    columns ``[k, *output.shape]``."""

    output: torch.Tensor
    walk: object
    batched: bool
    exact_columns: Callable[[int], Iterable[torch.Tensor]]
