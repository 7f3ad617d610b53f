"""One forward call of a module completed by the gradient w.r.t. its output: the unit every
per-module rule works on (``layers``), made from a ``records.Record`` by ``Record.call``."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Dict, List, Optional, Tuple, Union

import torch
from torch import nn


@dataclass
class Call:
    """One forward call of a module, completed by the gradient w.r.t. its output.

    ``args``/``kwargs`` are the inputs of the call, ``grad_out`` is ``dL/d output`` (a tuple
    when the module returned several tensors), ``batch_dim`` the dimension indexing samples.
    ``shared`` is a cache that lives as long as the recorded call (``records.Record``): what a
    rule computes from the inputs alone, for every ``Call`` made of that record.
    ``random`` is the generator state the module's forward drew from (``records.RandomState``,
    kept only for a module whose rule re-runs a random forward: attention dropout), and
    ``origin`` how this call derives from the recorded one: ``None`` (it is that call),
    ``("slice", parent, start, stop)`` (:meth:`slice`) or ``("expand", parent, columns)``
    (:meth:`expand`), so that a rule which must re-run the whole batch (to draw the same
    random numbers) can find it. ``quiet()`` is the context in which a rule re-runs the module
    or differentiates through it with curvopt's own hooks silenced: the pass gives it to the
    calls it makes (``records.Record.call``); a call made by hand, outside a pass, has nothing
    to silence.
    """

    module: nn.Module
    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]
    grad_out: Union[torch.Tensor, Tuple[torch.Tensor, ...], None] = None
    batch_dim: int = 0
    cache: Dict[str, Any] = field(default_factory=dict)
    random: Any = None
    origin: Optional[tuple] = None
    shared: Optional[dict] = None
    quiet: Callable[[], ContextManager] = contextlib.nullcontext

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

    def _map_batched(self, fn, value):
        """``fn`` applied to every tensor of ``value`` batched along ``batch_dim``."""
        n, bd = self.batch_size, self.batch_dim
        if isinstance(value, torch.Tensor) and value.dim() > bd and value.shape[bd] == n:
            return fn(value)
        if isinstance(value, tuple):
            return tuple(self._map_batched(fn, v) for v in value)
        return value

    def slice(self, start: int, stop: int) -> "Call":
        """The same call restricted to samples ``start:stop`` (tensors batched along batch_dim)."""

        def cut(x):
            return x.narrow(self.batch_dim, start, stop - start)

        return Call(
            self.module,
            self._map_batched(cut, self.args),
            {k: self._map_batched(cut, v) for k, v in self.kwargs.items()},
            self._map_batched(cut, self.grad_out),
            self.batch_dim,
            random=self.random,
            origin=("slice", self, start, stop),
            shared=self.shared,
            quiet=self.quiet,
        )

    def expanded_grad(self, columns):
        """The output gradient of :meth:`expand`'s call: ``columns`` ``[K, *out]`` (a tuple
        for several outputs) merged into the batch dim, ``K * N`` pseudo-samples."""
        bd = self.batch_dim

        def merge(v):
            if v is None:
                return None
            return (v if bd == 0 else v.movedim(0, bd)).flatten(bd, bd + 1)

        return tuple(merge(v) for v in columns) if isinstance(columns, tuple) else merge(columns)

    def without_grad(self) -> "Call":
        """The same call without its output gradient, with a cache of its own (what reads
        the inputs alone: the input side of Kronecker factors, ``kron_pass``)."""
        return Call(
            self.module,
            self.args,
            self.kwargs,
            None,
            self.batch_dim,
            cache={},
            random=self.random,
            origin=self.origin,
            shared=self.shared,
            quiet=self.quiet,
        )

    def expand(self, columns) -> "Call":
        """The call seen by ``K`` columns as ``K * N`` pseudo-samples (index ``k * N + n``).

        ``columns`` are ``[K, *out]`` (a tuple for several outputs); batched inputs are repeated.
        """
        bd = self.batch_dim
        first = next(
            c for c in (columns if isinstance(columns, tuple) else (columns,)) if c is not None
        )
        k = first.shape[0]

        def rep(x):
            shape = list(x.shape)
            return x.unsqueeze(bd).expand(*shape[:bd], k, *shape[bd:]).flatten(bd, bd + 1)

        return Call(
            self.module,
            self._map_batched(rep, self.args),
            {a: self._map_batched(rep, b) for a, b in self.kwargs.items()},
            self.expanded_grad(columns),
            bd,
            random=self.random,
            origin=("expand", self, columns),
            shared=self.shared,
            quiet=self.quiet,
        )


def output_tensors(output) -> List[torch.Tensor]:
    """The tensors of a module output, as the forward hooks see them, nested tuples flattened
    (``nn.LSTM``: ``(output, (h_n, c_n))``)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in output_tensors(item)]
    return []


def first_column(columns) -> torch.Tensor:
    """The first of ``columns`` that exists: the columns at a module's output (a tensor), or at
    each of its outputs (a tuple, ``None`` where none reached that output)."""
    if isinstance(columns, torch.Tensor):
        return columns
    return next(c for c in columns if c is not None)
