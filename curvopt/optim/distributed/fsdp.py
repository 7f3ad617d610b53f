"""FSDP2 (``fully_shard``): a step planned on the whole parameters, applied to each rank's shard.

Under ``torch.distributed.fsdp.fully_shard`` the optimizer holds sharded ``DTensor`` parameters
(rank ``r`` holds its rows of dim 0), whose gradient FSDP2 has reduce-scattered (the rank
average, the rank's rows). The curvature a backward pass writes on them is whole (the rank's
samples, the full shape: ``curvopt.core.sharded``) and is averaged over the ranks as under DDP
(:mod:`.averaging`). A Kronecker direction ``B⁻¹ G A⁻¹`` mixes every row of ``G``, so for
the step :class:`FullView` puts a whole stand-in in each sharded parameter's place:

1. **gather**: the parameter and its gradient are all-gathered (``DTensor.full_tensor``) into
   a plain ``nn.Parameter``, which carries the parameter's quantities (the same objects), its
   optimizer state and what its previous step consumed;
2. **step**: the optimizer plans and applies its step on the stand-ins as in one process (the
   inversions spread over the ranks as under DDP), reading each quantity's rank average by
   the sharded parameter it was launched for (:meth:`FullView.sharded`);
3. **scatter back**: each rank copies its rows of the stepped stand-in into its shard, and the
   state (whole: momentum, curvature EMA, inverses) returns to the sharded parameter.

Every rank computes the same whole step, so each shard moves exactly as the single-process
step on the concatenated batch would move its rows. The cost: an all-gather of every parameter
and gradient per step, and the whole parameters, gradients and optimizer state on every rank
(see ``docs/distributed.md#fsdp2``). One-dimensional meshes (``fully_shard`` over one group)
only.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from curvopt.core.sharded import is_sharded

try:
    from torch.distributed.tensor import Shard
except ImportError:  # a torch built without torch.distributed
    Shard = None

__all__ = ["FullView", "local_rows", "refuse_sharded"]


def refuse_sharded(optimizer: str, params, why: str) -> None:
    """Raise ``NotImplementedError`` where ``params`` hold an FSDP2-sharded parameter, for an
    optimizer (``optimizer``, its name) that does not run under ``fully_shard`` (``why``)."""
    if any(is_sharded(p) for p in params):
        raise NotImplementedError(
            f"{optimizer} does not run under FSDP2 (fully_shard) yet: {why}. Use KFAC, EKFAC "
            f"or DiagGGNNewton with fully_shard, or {optimizer} under DistributedDataParallel "
            "(docs/distributed.md)."
        )


def _shard_dim(p: torch.Tensor) -> int:
    """The dim ``p`` (a ``DTensor``) is sharded along, on its one-dimensional mesh.

    Raises:
        NotImplementedError: another placement (HSDP's two-dimensional mesh, replication).
    """
    placements = tuple(p.placements)
    if len(placements) != 1 or not isinstance(placements[0], Shard):
        raise NotImplementedError(
            f"curvopt's optimizers step FSDP2 parameters sharded along one dim of a "
            f"one-dimensional mesh, not a parameter of shape {tuple(p.shape)} placed as "
            f"{placements}. Apply fully_shard over one process group (no HSDP mesh, no tensor "
            "parallelism)."
        )
    return placements[0].dim


def local_rows(p: torch.Tensor, whole: torch.Tensor, leading: int = 0) -> torch.Tensor:
    """The part of ``whole`` (shaped ``[*lead, *p.shape]``, ``leading`` dims before ``p``'s)
    that the rank's shard of the ``DTensor`` ``p`` covers: FSDP2's chunks along its shard dim
    ``s``, ``⌈d_s/K⌉`` entries each, the rank's from ``rank·⌈d_s/K⌉`` on (a view).

    Args:
        p: a sharded parameter (``fully_shard``).
        whole: a tensor whose last ``p.ndim`` dims are ``p.shape`` (a quantity of ``p``).
        leading: how many dims precede them (1 for ``grad_batch``'s batch dim).

    Returns:
        ``whole`` narrowed to the rank's shard, shaped ``[*lead, *p.to_local().shape]``.

    Raises:
        ValueError: ``whole`` is not shaped ``[*lead, *p.shape]``.
        RuntimeError: the shard is not where FSDP2's chunking puts it (a changed torch).
        NotImplementedError: ``p`` is not sharded along one dim of a one-dimensional mesh.

    Example::

        mine = local_rows(layer.weight, layer.weight.grad_batch, leading=1)
    """
    dim, length = _shard_dim(p), p.to_local().shape[_shard_dim(p)]
    if tuple(whole.shape[leading:]) != tuple(p.shape):
        raise ValueError(
            f"local_rows: a tensor of shape {tuple(whole.shape)} is not a quantity of a "
            f"parameter of shape {tuple(p.shape)} after {leading} leading dims. Pass the "
            "parameter's own quantity and the number of its leading (batch) dims."
        )
    size, world = p.shape[dim], p.device_mesh.size()
    chunk = math.ceil(size / world)
    start = min(p.device_mesh.get_local_rank() * chunk, size)
    if length != min(chunk, size - start):
        raise RuntimeError(
            f"local_rows: the FSDP2 shard of a parameter of shape {tuple(p.shape)} holds "
            f"{length} entries of dim {dim}, not the {min(chunk, size - start)} of FSDP2's "
            "chunking that curvopt assumes. Use a torch version curvopt supports (see "
            "docs/distributed.md#fsdp2)."
        )
    return whole.narrow(leading + dim, start, length)


class FullView:
    """The stand-ins of an optimizer's sharded parameters, put in their place by :meth:`of`
    (a collective: every rank opens it with the same groups). A view holds no reference to
    its optimizer outside :meth:`of` (the optimizer keeps it: no reference cycle)."""

    def __init__(self):
        self._swapped: list[tuple[dict, int, torch.Tensor, nn.Parameter]] = []
        self._origin: dict[int, torch.Tensor] = {}

    def sharded(self, param: torch.Tensor) -> torch.Tensor:
        """The sharded parameter a stand-in replaces (``param`` itself otherwise)."""
        return self._origin.get(id(param), param)

    @contextlib.contextmanager
    def of(self, optimizer):
        """While open, each sharded parameter of ``optimizer``'s groups is replaced by its
        whole stand-in; on a clean exit each rank copies its rows of the stand-in into its
        shard. Without sharded parameters nothing changes."""
        self._enter(optimizer)
        try:
            yield self
        except BaseException:
            self._leave(optimizer, apply=False)
            raise
        self._leave(optimizer, apply=True)

    @torch.no_grad()
    def _enter(self, opt) -> None:
        for group in opt.param_groups:
            for index, p in enumerate(group["params"]):
                if not is_sharded(p):
                    continue
                _shard_dim(p)  # a placement it can step, else it raises now
                whole = nn.Parameter(p.full_tensor(), requires_grad=p.requires_grad)
                if p.grad is not None:
                    whole.grad = p.grad.full_tensor()
                for attr, value in vars(p).items():
                    if not attr.startswith("_"):  # the quantities curvopt wrote
                        whole.__dict__[attr] = value
                _move(opt, p, whole)
                group["params"][index] = whole
                self._swapped.append((group, index, p, whole))
                self._origin[id(whole)] = p

    @torch.no_grad()
    def _leave(self, opt, apply: bool) -> None:
        for group, index, p, whole in self._swapped:
            group["params"][index] = p
            _move(opt, whole, p)
            if apply:
                p.to_local().copy_(local_rows(p, whole))
        self._swapped.clear()
        self._origin.clear()


def _move(opt, old: torch.Tensor, new: torch.Tensor) -> None:
    """The optimizer's state and consumed record of ``old`` become ``new``'s."""
    if old in opt.state:
        opt.state[new] = opt.state.pop(old)
    if old in opt._consumed:
        opt._consumed[new] = opt._consumed.pop(old)
