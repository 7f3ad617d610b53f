"""The planned step of one parameter (:class:`ParamUpdate`) and the cache entries its state
keeps (:func:`cached`): the data a step is planned in, shared by the optimizer base
(``optim.base``, which checks a whole plan and applies it), the stages and the optimizers.

When a curvature is refreshed: :func:`refresh_interval` (``curvature_interval``'s default).

Blocks of equal shapes preconditioned together (:func:`buckets`, :class:`Stacks`): one batched
matrix product on ``[B, n, n]`` stacks in place of a Python loop over the parameters. Between
two refreshes a Kronecker step is two small products per layer, ``B⁻¹ G A⁻¹``; the layers
whose cached operands have equal shapes, dtype and device (a transformer's blocks, an MLP of
equal widths) form one bucket and are applied as ``B⁻¹_stack @ G_stack @ A⁻¹_stack``,
``G_stack [B, out, in]`` the bucket's gradients (:func:`stacked_matrices`, :func:`unstacked`).
The stacks of the cached operands are formed once after a refresh and kept (:class:`Stacks`)
until one of their sources is replaced, not stacked again at every step. A block alone in its
bucket is applied by its own products, as it always was: the same kernels, the same bits. A
batched product equals the per-layer ones up to rounding (a batched kernel may order its sums
differently: about ``1e-16`` relative in float64; tested against the loop to ``1e-12``).

Where it pays (:func:`batches_pay`): on an accelerator, where every product is a kernel launch
and a bucket of ``k`` blocks saves ``2(k − 1)`` of them; not on a CPU, where a product is a
function call of a few microseconds and ``torch.matmul`` on stacks was measured slower than
the loop (one thread: two blocks of ``[192, 64]`` 101 µs against 89, of ``[384, 128]`` 684
against 678; eight of ``[64, 64]`` 85 against 89), so a CPU step applies its blocks one by one.

A cache entry (:func:`cached`: inverses, eigendecompositions) is the plain dict
``{"value": ..., "key": ..., "step": int}`` so that it can live in an optimizer's ``state``
and be saved with ``state_dict``.
"""

from __future__ import annotations

import operator
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

#: ``k`` when none is given under the default damping (:func:`refresh_interval`): the
#: curvature (and its inverses) refreshed every ``k`` steps, the steps in between plain ones
#: that leave the engine alone (``frontend.collection``); the first step always refreshes
DEFAULT_CURVATURE_INTERVAL = 10


def refresh_interval(curvature_interval: int | None, damping) -> int:
    """A group's curvature interval: ``curvature_interval`` as given, or for ``None`` (the
    default) :data:`DEFAULT_CURVATURE_INTERVAL` under the default damping (``damping=None``)
    and 1 (every step, the paper's update) with a damping given."""
    if curvature_interval is not None:
        return curvature_interval
    return DEFAULT_CURVATURE_INTERVAL if damping is None else 1


@dataclass
class ParamUpdate:
    """The planned change of one parameter: ``θ ← θ − delta`` and its new ``state``."""

    param: torch.Tensor
    description: str
    delta: torch.Tensor | None = None
    state: dict[str, Any] = field(default_factory=dict)
    #: ``(what, tensor)`` pairs that must be finite for the step to be taken
    checks: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    #: the quantity objects read from the parameter (to detect stale ones next time)
    consumed: dict[str, Any] = field(default_factory=dict)


CacheEntry = dict[str, Any]


def cached(
    entry: CacheEntry | None,
    key: Hashable,
    step: int,
    interval: int,
    compute: Callable[[], Any],
) -> CacheEntry:
    """The cache entry to use at ``step``: ``entry`` itself, or a new one holding ``compute()``.

    ``compute`` runs when there is no entry, or when the inputs changed (``key`` differs from
    ``entry["key"]``) and at least ``interval`` steps passed since ``entry["step"]``. So with
    ``interval = m`` an inverse is recomputed at most every ``m`` steps, and never while its
    inputs (e.g. curvature version, damping) stay the same. ``entry`` is not modified.

    Args:
        entry: the previous entry ``{"value", "key", "step"}``, or ``None``.
        key: what the value depends on (compared with ``!=``).
        step: the current step count.
        interval: the least number of steps between two computations.
        compute: a callable returning the new value.

    Returns:
        The entry (a dict with ``"value"``, ``"key"`` and ``"step"``).

    Example:
        >>> from curvopt.optim import cached
        >>> entry = cached(None, key="a", step=0, interval=2, compute=lambda: 1)
        >>> cached(entry, key="b", step=1, interval=2, compute=lambda: 2)["value"]  # too early
        1
        >>> cached(entry, key="b", step=2, interval=2, compute=lambda: 2)["value"]
        2
    """
    if entry is None or (entry["key"] != key and step - entry["step"] >= interval):
        return {"value": compute(), "key": key, "step": step}
    return entry


def batches_pay(device: torch.device) -> bool:
    """Whether blocks on ``device`` are applied in batches: not on a CPU (see the module doc)."""
    return device.type != "cpu"


def buckets(keys: Iterable[Hashable | None]) -> dict[Hashable, list[int]]:
    """The positions of ``keys`` by key, in order; a ``None`` key joins no bucket."""
    out: dict[Hashable, list[int]] = {}
    for position, key in enumerate(keys):
        if key is not None:
            out.setdefault(key, []).append(position)
    return out


def shape_key(tensors: Sequence[torch.Tensor]) -> tuple:
    """What blocks must share to be stacked: the shapes, dtypes and devices of ``tensors``."""
    return tuple((tuple(t.shape), t.dtype, t.device) for t in tensors)


class Stacks:
    """The stacked operands of an optimizer's batched products, kept from step to step.

    ``stacked(key, tensors)`` is ``torch.stack(tensors)``, formed again only when ``tensors``
    are not the very tensors of the last call under ``key`` (a refresh replaces the cached
    inverses, so the next step stacks anew). A cache of copies: it steers no number, and it is
    neither saved nor pickled with the optimizer.

    Example:
        >>> import torch
        >>> stacks, blocks = Stacks(), [torch.eye(2), 2 * torch.eye(2)]
        >>> stacks.stacked("inverses", blocks) is stacks.stacked("inverses", blocks)
        True
        >>> stacks.stacked("inverses", blocks).shape
        torch.Size([2, 2, 2])
    """

    def __init__(self):
        self._kept: dict[Hashable, tuple[tuple[torch.Tensor, ...], torch.Tensor]] = {}

    def stacked(self, key: Hashable, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        kept = self._kept.get(key)
        if kept is not None and _same(kept[0], tensors):
            return kept[1]
        stack = torch.stack(list(tensors))
        self._kept[key] = (tuple(tensors), stack)
        return stack


class Prepared:
    """What a plain step derives from its cached state and its param groups, kept from step
    to step.

    Between two refreshes a parameter's cache entries (inverses, bases: the dicts of
    :func:`cached`, replaced, never changed in place) stay the very objects, so what a step
    derives from them (the inverse resolved for its products, the eigenvalues plus the damping)
    is the same at every plain step. ``get(key, sources, inputs)`` returns what ``put`` kept
    under ``key`` while ``sources`` are the very objects kept with it (compared by identity,
    in one pass) and ``inputs`` (damping, options, the gradients' shapes, dtypes and devices)
    compare equal, else None: a refresh, a new damping or param group option, a loaded
    ``state_dict`` (new objects), another set of parameters taking part (a gradient that is
    None, ``requires_grad`` switched) or a move to another dtype or device prepares anew. A
    key is a whole param group's (its sources the parameters taking part, then their entries;
    its value one item per parameter), so that a plain step looks up once per group, not once
    per parameter. Like :class:`Stacks` a cache that steers no number (what it holds is what
    the step would derive again), neither saved nor pickled.

    Example:
        >>> import torch
        >>> prepared, entry = Prepared(), {"value": torch.eye(2)}
        >>> prepared.put("w", (entry,), (0.1,), "solve")
        >>> prepared.get("w", (entry,), (0.1,)), prepared.get("w", (entry,), (0.2,))
        ('solve', None)
        >>> prepared.get("w", (dict(entry),), (0.1,)) is None  # another object: a refresh
        True
    """

    def __init__(self):
        self._kept: dict[Hashable, tuple[tuple, tuple, Any]] = {}

    def get(self, param: Hashable, sources: Sequence[Any], inputs: tuple) -> Any:
        kept = self._kept.get(param)
        if kept is not None and _same(kept[0], sources) and kept[1] == inputs:
            return kept[2]
        return None

    def put(self, param: Hashable, sources: Sequence[Any], inputs: tuple, value: Any) -> None:
        self._kept[param] = (tuple(sources), inputs, value)


def _same(kept: Sequence[Any], tensors: Sequence[Any]) -> bool:
    return len(kept) == len(tensors) and all(map(operator.is_, kept, tensors))


def stacked_matrices(grads: Sequence[torch.Tensor], rows: int, dtype: torch.dtype) -> torch.Tensor:
    """The gradients as the matrices ``G`` the products act on, stacked: ``[B, rows, ·]``
    in ``dtype``."""
    return torch.stack([g.reshape(rows, -1) for g in grads]).to(dtype)


def unstacked(result: torch.Tensor, grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``result [B, ...]`` back as one tensor per gradient, each of its gradient's shape and
    dtype (views of ``result`` where the dtype is the same)."""
    return [r.reshape(g.shape).to(g.dtype) for r, g in zip(result.unbind(), grads)]
