"""What one call of an extended module leaves for the backward pass."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple, Union

import torch
from torch import nn


@dataclass
class Call:
    """One forward call of a module, completed by the gradient w.r.t. its output.

    ``args``/``kwargs`` are the inputs of the call, ``grad_out`` is ``dL/d output`` (a tuple
    when the module returned several tensors), ``batch_dim`` the dimension indexing samples.
    """

    module: nn.Module
    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]
    grad_out: Union[torch.Tensor, Tuple[torch.Tensor, ...], None] = None
    batch_dim: int = 0
    cache: Dict[str, Any] = field(default_factory=dict)

    @property
    def input(self) -> torch.Tensor:
        """The first positional input."""
        return self.args[0]

    @property
    def first_grad(self) -> torch.Tensor:
        """The gradient of the first output that received one."""
        if isinstance(self.grad_out, torch.Tensor):
            return self.grad_out
        return next(g for g in self.grad_out if g is not None)

    @property
    def batch_size(self) -> int:
        return self.first_grad.shape[self.batch_dim]

    def slice(self, start: int, stop: int) -> "Call":
        """The same call restricted to samples ``start:stop`` (tensors batched along batch_dim)."""
        n = self.batch_size

        def cut(x):
            if (
                isinstance(x, torch.Tensor)
                and x.dim() > self.batch_dim
                and x.shape[self.batch_dim] == n
            ):
                return x.narrow(self.batch_dim, start, stop - start)
            if isinstance(x, tuple):
                return tuple(cut(y) for y in x)
            return x

        return Call(
            self.module,
            cut(self.args),
            {k: cut(v) for k, v in self.kwargs.items()},
            cut(self.grad_out),
            self.batch_dim,
        )


def output_tensors(output) -> List[torch.Tensor]:
    """The top-level tensors of a module output, as the forward hooks see them."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for t in output if isinstance(t, torch.Tensor)]
    return []
