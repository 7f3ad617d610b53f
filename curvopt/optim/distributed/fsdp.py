"""FSDP2 (``fully_shard``): a step planned on whole parameters, applied to each rank's shard.

Under ``torch.distributed.fsdp.fully_shard`` the optimizer holds sharded ``DTensor`` parameters
(rank ``r`` holds its rows of dim 0), whose gradient FSDP2 has reduce-scattered (the rank
average, the rank's rows). The curvature a backward pass writes on them is whole (the rank's
samples, the full shape: ``curvopt.core.sharded``) and is averaged over the ranks as under DDP
(:mod:`.averaging`). A Kronecker direction ``B⁻¹ G A⁻¹`` mixes every row of ``G``, so for
the step :class:`FullView` puts a stand-in in each sharded parameter's place, in one of three
layouts (the optimizer's ``_sharded_layout``).

**Whole** (``FullView.of(optimizer, "whole")``: ``EKFAC``, whose every pass needs every
layer's bases on every rank, and groups with adaptive damping, ``orthogonalize`` or
``schedule_free``):

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
and gradient per step, and the whole parameters, gradients and optimizer state on every rank.

**State kept by owners** (``FullView.of(optimizer, "owned")``: ``KFAC``, ``DiagGGNNewton``,
:mod:`.owners`): each sharded parameter has one owner rank. Only the owner gets the whole
stand-in (its rows and its gradient's gathered by all-to-alls, :func:`~.owners.to_owners`),
reads the averaged curvature, keeps it (its EMA, inverses) and computes the whole direction;
the other ranks step a stand-in of their shard (:class:`Rows`: it shares the shard's memory).
After the
preconditioning stage :func:`exchange` sends each rank its rows of every direction (one
all-to-all); the stages after it are element-wise (momentum, kept as the rank's rows, and the
learning rate) or sum over the rows and all-reduce the scalar (the trust region's ``gᵀd``).
A failure on one rank (a failed inversion, a non-finite value) is raised on every rank
(:meth:`FullView.agreeing`, :func:`exchange`). See ``docs/distributed.md#fsdp2``.

**Rows** (``FullView.of(optimizer, "rows")``: ``VarianceAdaptedSGD``, whose step is
element-wise): every rank steps a stand-in of its shard, reads its rows of the averaged
quantities (:meth:`FullView.rows_of`) and keeps its rows of the state; nothing is gathered.
One-dimensional meshes (``fully_shard`` over one group) only.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from curvopt.core.sharded import is_sharded
from curvopt.optim.distributed.owners import from_owners, owners_of, rows_of, to_owners

try:
    from torch.distributed.tensor import Shard
except ImportError:  # a torch built without torch.distributed
    Shard = None

__all__ = ["FullView", "Rows", "exchange", "local_rows"]


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


@dataclass
class Rows:
    """A sharded parameter stepped as rows (``FullView.of(..., "owned" or "rows")``)."""

    #: the sharded ``DTensor`` parameter (the optimizer's state is keyed by it between steps)
    sharded: torch.Tensor
    #: the rank that keeps its curvature and computes its whole direction
    owner: int
    #: whether that is this rank
    mine: bool
    #: the rank's shard as a plain parameter sharing its memory (its gradient: the shard's)
    local: nn.Parameter


class FullView:
    """The stand-ins of an optimizer's sharded parameters, put in their place by :meth:`of`
    (a collective: every rank opens it with the same groups). A view holds no reference to
    its optimizer outside :meth:`of` (the optimizer keeps it: no reference cycle)."""

    def __init__(self):
        self._swapped: list[tuple[dict, int, torch.Tensor, nn.Parameter, Rows | None]] = []
        self._origin: dict[int, torch.Tensor] = {}
        self._rows: dict[int, Rows] = {}
        self._distributed = None  # the DistributedCurvature, while open with owned state

    def sharded(self, param: torch.Tensor) -> torch.Tensor:
        """The sharded parameter a stand-in replaces (``param`` itself otherwise)."""
        return self._origin.get(id(param), param)

    def rows(self, param: torch.Tensor) -> Rows | None:
        """The :class:`Rows` of a stand-in while the view is open as ``"owned"`` or ``"rows"``,
        else None."""
        return self._rows.get(id(param))

    def remote(self, param: torch.Tensor) -> bool:
        """Whether another rank keeps the state of the stand-in ``param`` (``"owned"``)."""
        rows = self._rows.get(id(param))
        return rows is not None and not rows.mine

    def whole_like(self, param: torch.Tensor) -> torch.Tensor:
        """``param``, or for the stand-in of a shard another rank owns a tensor of the whole
        parameter's shape and dtype on the meta device (no memory), to check quantities by."""
        if not self.remote(param):
            return param
        sharded = self.sharded(param)
        return torch.empty(sharded.shape, dtype=sharded.dtype, device="meta")

    def rows_of(self, param: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
        """The rank's rows of a quantity ``whole`` of the stand-in ``param`` (shaped like the
        sharded parameter) while the view is open with :class:`Rows`, else ``whole``."""
        rows = self._rows.get(id(param))
        if rows is None:
            return whole
        return rows_of(rows.sharded, whole, self._distributed.rank)

    @contextlib.contextmanager
    def of(self, optimizer, layout: str = "whole"):
        """While open, each sharded parameter of ``optimizer``'s groups is replaced by a
        stand-in. ``layout`` (``optimizer._distributed`` set for the last two):

        * ``"whole"``: a whole stand-in on every rank; on a clean exit each rank copies its
          rows of it into its shard;
        * ``"owned"``: a whole stand-in on the parameter's owner only, on the other ranks one
          of their shard (:class:`Rows`), stepped in place;
        * ``"rows"``: on every rank a stand-in of its shard, stepped in place.

        Without sharded parameters nothing changes."""
        if layout == "owned":
            self._enter_owned(optimizer)
        elif layout == "rows":
            self._enter_rows(optimizer)
        else:
            self._enter(optimizer)
        try:
            yield self
        except BaseException:
            self._leave(optimizer, apply=False)
            raise
        self._leave(optimizer, apply=True)

    @contextlib.contextmanager
    def agreeing(self):
        """A block whose ``FloatingPointError`` is raised on every rank (owned state: a rank
        checks its own part of the step); one small all-reduce. Otherwise a plain block."""
        if self._distributed is None:
            yield
            return
        failure = None
        try:
            yield
        except FloatingPointError as error:
            failure = error
        if _failed_on(self._distributed, failure is not None) is None:
            return
        if failure is not None:
            raise failure
        raise FloatingPointError(
            "a step checked on another rank is not finite (see the error there); no parameter "
            "was updated"
        )

    def agreed(self, flags: list[bool]) -> list[bool]:
        """``flags`` that hold on every rank (an all-reduce of their minimum) while open with
        owned state (each rank sees its part of a parameter), else ``flags``."""
        if self._distributed is None or not flags:
            return flags
        tensor = torch.tensor([int(f) for f in flags], dtype=torch.int64, device=_device(self))
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self._distributed.group)
        return [bool(f) for f in tensor.tolist()]

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
                _carry(p, whole)
                self._put(opt, group, index, p, whole, None)

    @staticmethod
    def _checked(opt):
        """``opt``'s ``DistributedCurvature``, once every sharded parameter is sharded along
        one dim over its process group (else ``NotImplementedError`` naming the fix)."""
        component = opt._distributed
        for group in opt.param_groups:
            for p in filter(is_sharded, group["params"]):
                _shard_dim(p)  # a placement it can step, else it raises now
                mesh = p.device_mesh
                if (mesh.size(), mesh.get_local_rank()) != (component.world_size, component.rank):
                    raise NotImplementedError(
                        f"a parameter of shape {tuple(p.shape)} is sharded over {mesh.size()} "
                        f"ranks (this one rank {mesh.get_local_rank()}), the optimizer's process "
                        f"group has {component.world_size} (this one rank {component.rank}). "
                        "Give the optimizer the group fully_shard shards over (process_group=)."
                    )
        return component

    @torch.no_grad()
    def _enter_owned(self, opt) -> None:
        found = [
            (group, index, p)
            for group in opt.param_groups
            for index, p in enumerate(group["params"])
            if is_sharded(p)
        ]
        component = self._checked(opt)
        params = [p for _, _, p in found]
        owners = owners_of(params, component.world_size)
        stepped = [i for i, p in enumerate(params) if p.grad is not None]
        taken = [params[i] for i in stepped]
        whole_of = {}
        for tensors in ([p.to_local() for p in taken], [p.grad.to_local() for p in taken]):
            gathered = to_owners(
                tensors, taken, [owners[i] for i in stepped], component.group, component.stats
            )
            for i, tensor in zip(stepped, gathered):
                whole_of.setdefault(i, []).append(tensor)
        self._distributed = component
        for i, (group, index, p) in enumerate(found):
            local = self._local(p)
            rows = Rows(p, owners[i], owners[i] == component.rank, local)
            stand_in = local
            if rows.mine and i in whole_of:
                theta, grad = whole_of[i]
                stand_in = nn.Parameter(theta, requires_grad=p.requires_grad)
                stand_in.grad = grad
                _carry(p, stand_in)
            self._origin[id(local)] = p
            self._rows[id(local)] = self._rows[id(stand_in)] = rows
            self._put(opt, group, index, p, stand_in, rows)

    @torch.no_grad()
    def _enter_rows(self, opt) -> None:
        component = self._checked(opt)
        self._distributed = component
        for group in opt.param_groups:
            for index, p in enumerate(group["params"]):
                if is_sharded(p):
                    local = self._local(p)
                    rows = Rows(p, component.rank, True, local)
                    self._rows[id(local)] = rows
                    self._put(opt, group, index, p, local, rows)

    @staticmethod
    def _local(p: torch.Tensor) -> nn.Parameter:
        """A plain parameter sharing the memory of ``p``'s shard, with its gradient's shard
        and ``p``'s quantities."""
        local = nn.Parameter(p.to_local(), requires_grad=p.requires_grad)
        if p.grad is not None:
            local.grad = p.grad.to_local()
        _carry(p, local)
        return local

    def _put(self, opt, group, index, p, stand_in, rows) -> None:
        _move(opt, p, stand_in)
        group["params"][index] = stand_in
        self._swapped.append((group, index, p, stand_in, rows))
        self._origin[id(stand_in)] = p

    @torch.no_grad()
    def _leave(self, opt, apply: bool) -> None:
        for group, index, p, stand_in, rows in self._swapped:
            group["params"][index] = p
            if rows is None:
                _move(opt, stand_in, p)
                if apply:
                    p.to_local().copy_(local_rows(p, stand_in))
                continue
            # the step keeps its new state under the shard's stand-in (``exchange``); a
            # parameter that took no part keeps its state where the view put it
            _move(opt, stand_in, p)
            if rows.local is not stand_in and rows.local in opt.state:
                opt.state[p] = opt.state.pop(rows.local)
            if rows.local is not stand_in and rows.local in opt._consumed:
                opt._consumed.setdefault(p, {}).update(opt._consumed.pop(rows.local))
        self._swapped.clear()
        self._origin.clear()
        self._rows.clear()
        self._distributed = None


def exchange(items, failure: BaseException | None, component) -> None:
    """After the preconditioning stage with owned state: raise on every rank if any failed
    (``failure``: this rank's error), then give every rank its rows of each direction that
    an owner computed (:func:`~.owners.from_owners`); the items of sharded parameters then
    step the rank's shard (``Rows.local``): its gradient rows, direction rows, and a state
    that names the owner where another rank keeps the curvature (``curvature_owner``)."""
    failed = _failed_on(component, failure is not None, linalg=_is_linalg(failure))
    if failed is not None:
        rank, linalg = failed
        if failure is not None:
            raise failure
        kind = torch.linalg.LinAlgError if linalg else RuntimeError
        raise kind(
            f"computing a direction failed on rank {rank} (see the error there); no parameter "
            "was updated"
        )
    sharded = [item for item in items if item.rows is not None]
    received = from_owners(
        [item.direction if item.rows.mine else None for item in sharded],
        [item.rows.sharded for item in sharded],
        [item.rows.owner for item in sharded],
        [item.rows.local for item in sharded],
        component.group,
        component.stats,
    )
    for item, direction in zip(sharded, received):
        rows = item.rows
        if rows.mine:
            item.grad = rows_of(rows.sharded, item.grad, component.rank)
        else:
            item.update.state = {"curvature_owner": rows.owner}
        item.direction = direction
        item.update.param = rows.local


def _is_linalg(error) -> bool:
    return isinstance(error, torch.linalg.LinAlgError)


def _failed_on(component, failed: bool, linalg: bool = False) -> tuple[int, bool] | None:
    """``(rank, linalg)`` of the highest rank that failed, or None: one int64 all-reduced."""
    code = 1 + 2 * component.rank + int(linalg) if failed else 0
    device = "cuda" if dist.get_backend(component.group) == "nccl" else "cpu"
    tensor = torch.tensor([code], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=component.group)
    component.stats.control_calls += 1
    component.stats.control_bytes += 8
    code = int(tensor.item())
    return None if code == 0 else ((code - 1) // 2, bool((code - 1) % 2))


def _device(view: FullView) -> str:
    return "cuda" if dist.get_backend(view._distributed.group) == "nccl" else "cpu"


def _carry(p: torch.Tensor, stand_in: nn.Parameter) -> None:
    """The quantities curvopt wrote on ``p`` (the same objects) put on its stand-in."""
    for attr, value in vars(p).items():
        if not attr.startswith("_"):
            stand_in.__dict__[attr] = value


def _move(opt, old: torch.Tensor, new: torch.Tensor) -> None:
    """The optimizer's state and consumed record of ``old`` become ``new``'s."""
    if old in opt.state:
        opt.state[new] = opt.state.pop(old)
    if old in opt._consumed:
        opt._consumed[new] = opt._consumed.pop(old)
