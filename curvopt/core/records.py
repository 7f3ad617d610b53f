"""What one call of an extended module (or loss) leaves for the backward pass.

A forward hook creates a :class:`Record` per call and lists it in the metadata of each output's
autograd node (:func:`records_on` reads it back), so the backward pass can find every module
call upstream of a tensor; the gradient hook on the output (``routing.module_hook``) hands
the record to the pass, which completes it into a :class:`Call`, the unit every per-module
rule works on. A record is data: it calls nothing above it.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from typing import List, Optional, Tuple

import torch
from torch import nn

from curvopt.core.calls import Call, first_column
from curvopt.core.extended import ModuleEntry, entry_for
from curvopt.core.params import trainable
from curvopt.core.state import STATE

#: key of the autograd-node metadata listing the module calls whose output the node produced
_METADATA = "curvopt"
_SEQUENCE = itertools.count()
_TOKENS: "weakref.WeakKeyDictionary[nn.Module, int]" = weakref.WeakKeyDictionary()
_TOKEN_COUNT = itertools.count()


def token(module) -> int:
    """A number naming ``module`` in cache keys, never reused by another module (``id`` is,
    once a module is freed: fresh models in a sweep)."""
    value = _TOKENS.get(module)
    if value is None:
        value = _TOKENS[module] = next(_TOKEN_COUNT)
    return value


def anchor(t: torch.Tensor, inputs=()) -> torch.Tensor:
    """Where the gradient of a module's only output is read: ``t`` itself, or, for a reshaped
    view of a tensor the call made (``nn.Linear`` on ``[N, T, D]`` returns a view of
    ``[N T, out]``), its base. The view's autograd node leaves the graph when the output is
    modified in place (``h.relu_()``, ``h += 1``); the base's node stays, and sees the gradient
    before the change."""
    base = t._base if t._is_view() else None
    if (
        base is None
        or base.grad_fn is None
        or base.numel() != t.numel()
        or base.storage_offset() != t.storage_offset()
        or not (t.is_contiguous() and base.is_contiguous())
        or any(base is x for x in inputs)
    ):
        return t
    return base


class RandomState:
    """The state of the generator that a module's forward is about to draw from (the default
    generator of ``device``'s type), so that a rule can re-run the forward with the same random
    numbers: the dropout masks drawn in the forward are part of the function."""

    __slots__ = ("device", "state")

    def __init__(self, device: torch.device):
        self.device = device
        self.state = _generators(device).get_rng_state(*_index(device))

    @contextlib.contextmanager
    def replay(self):
        """Within the block the generator draws what it drew from this state; the state the
        block found is restored at its end."""
        devices = [] if self.device.type == "cpu" else [self.device]
        with torch.random.fork_rng(devices=devices, device_type=self.device.type):
            _generators(self.device).set_rng_state(self.state, *_index(self.device))
            yield


def _generators(device: torch.device):
    """The module with ``get_rng_state``/``set_rng_state`` for ``device``'s default generator."""
    return torch if device.type == "cpu" else torch.get_device_module(device.type)


def _index(device: torch.device) -> tuple:
    return () if device.type == "cpu" else (device,)


#: the generator state each module's current forward started from (``note_random_state``),
#: until its forward hook moves it into the call's record (``take_random_state``)
_DRAWN: "weakref.WeakKeyDictionary[nn.Module, RandomState]" = weakref.WeakKeyDictionary()


def note_random_state(module: nn.Module, device: torch.device) -> None:
    """Keep the generator state ``module``'s forward is about to draw from."""
    _DRAWN[module] = RandomState(device)


def take_random_state(module: nn.Module) -> Optional[RandomState]:
    """The state :func:`note_random_state` kept for ``module``'s forward that just ended."""
    return _DRAWN.pop(module, None)


def records_on(node) -> List[Tuple["Record", int, int]]:
    """``(record, output index, node output nr)`` of the live module calls ``node`` produced."""
    entries = node.metadata.get(_METADATA)
    if entries is None:  # (most nodes of a walk: no list made for them)
        return []
    return [e for e in entries if e[0].args is not None]


class Record:
    """One call of an extended module: its inputs until the gradient w.r.t. its output arrives.

    ``out_shapes`` are the shapes of the outputs that require grad, ``batch_dim`` the dim of
    the first of them that indexes samples (as the module's rule defines it). ``broadcast`` is
    set by the backward pass for a call without a batch dim whose output is broadcast over the
    batch (``curvopt.graph.broadcast``).
    """

    __slots__ = (
        "module",
        "args",
        "kwargs",
        "out_shapes",
        "batch_dim",
        "dtype",
        "device",
        "seq",
        "broadcast",
        "positionwise",
        "transposed",
        "outer",
        "random",
        "shared",
        "extended",
        "sites",
    )

    def __init__(
        self,
        module,
        args,
        kwargs,
        outputs,
        batch_dim,
        positionwise=False,
        anchors=None,
        random: Optional[RandomState] = None,
        extended: Optional[ModuleEntry] = None,
        outer: Optional[int] = None,
    ):
        self.args = None  # set last: ``release`` must work on a half-built record
        #: the module's entry in ``extended`` (its calls awaiting their gradients are counted
        #: there), as the forward hook had it: still counted down after ``unextend``
        self.extended = entry_for(module) if extended is None else extended
        self.random = random  # the generator state of a random forward its rule re-runs
        self.shared = None  # what rules compute from the inputs alone (``Call.shared``)
        self.module, self.kwargs = module, kwargs
        self.out_shapes = tuple(t.shape for t in outputs)
        self.batch_dim = batch_dim
        self.dtype, self.device = outputs[0].dtype, outputs[0].device
        self.seq = next(_SEQUENCE)  # forward order
        self.broadcast = None
        #: the module's raw parameters that a curvature pass reads at their sites, each a call
        #: of its own (``engine.parameter_sites``): ``{name: that call}``, or None
        self.sites = None
        self.positionwise = positionwise
        self.transposed = False  # the batch is dim 1 of a positionwise call (sequence-first)
        #: the backward pass that runs this call's forward (a reentrant checkpoint recomputing
        #: its segment), whose state its gradient belongs to; None for an ordinary forward
        self.outer = outer
        self.extended.live += 1
        self.args = args
        for index, t in enumerate(outputs if anchors is None else anchors):
            if t.grad_fn is not None:
                t.grad_fn.metadata.setdefault(_METADATA, []).append((self, index, t.output_nr))

    @property
    def out_numel(self) -> Tuple[int, ...]:
        return tuple(s.numel() for s in self.out_shapes)

    @property
    def batch_size(self) -> int:
        if self.broadcast is not None:
            return self.broadcast.samples
        shape = self.out_shapes[0]
        dim = 1 if self.transposed else self.batch_dim
        return shape[dim] if len(shape) > dim else 1

    def batch_first(self, x):
        """``x`` with the batch moved to dim 0 where the call is transposed (sequence-first):
        ``[T, N, ...] -> [N, T, ...]`` (``[k, T, N, ...] -> [k, N, T, ...]`` for ``columns``)."""
        if not self.transposed or not isinstance(x, torch.Tensor) or x.dim() < 2:
            return x
        return x.movedim(1, 0)

    def column_call(self, outs):
        """``(call, columns, N)``: the call as the rules see it (:meth:`call`) given the columns
        ``outs`` propagated to its outputs (one per output, ``None`` where none reached it;
        in the parameters' precision), with a stand-in ``grad_out`` of one column's shape (the
        rules read the batch size off it); ``(None, None, 0)`` where no column reached it."""
        if all(v is None for v in outs):
            return None, None, 0
        columns = self.at_parameter_precision(outs[0] if len(outs) == 1 else tuple(outs))
        call = self.call()
        n = first_column(columns).shape[1 + call.batch_dim]
        call.grad_out = _one_column(columns)
        return call, columns, n

    def call(self, grad_out=None) -> "Call":
        """The call as the rules see it (inputs repeated over the batch for a broadcast call;
        in the parameters' precision, see :meth:`at_parameter_precision`)."""
        args, kwargs, grad_out = self.at_parameter_precision((self.args, self.kwargs, grad_out))
        if self.broadcast is not None:
            args = tuple(self.broadcast.repeat(x) for x in args)
            kwargs = {k: self.broadcast.repeat(v) for k, v in kwargs.items()}
        if self.transposed:
            args = tuple(self.batch_first(x) for x in args)
            kwargs = {k: self.batch_first(v) for k, v in kwargs.items()}
        if self.shared is None:
            self.shared = {}
        return Call(
            self.module,
            args,
            kwargs,
            grad_out,
            self.batch_dim,
            random=self.random,
            shared=self.shared,
            quiet=STATE.suspend,
        )

    def computed(self) -> list:
        """The ``(name, p)`` a curvature pass computes through this call: its module's
        trainable parameters, less those read at their sites (:attr:`sites`)."""
        params = trainable(self.module)
        if not self.sites:
            return params
        return [(name, p) for name, p in params if name not in self.sites]

    def at_parameter_precision(self, value):
        """``value`` (tensors, nested in tuples, lists, dicts) as the rules take it: when the
        module computed in a dtype other than its parameters' (autocast), every floating tensor
        rounded to that dtype (as the module used it), then cast to the parameters' dtype, so
        that each quantity is computed and accumulated in the parameters' dtype, like
        ``p.grad``; otherwise ``value`` itself."""
        target = _parameter_precision(self.module, self.dtype)
        return value if target is None else _cast(value, *target)

    def release(self):
        """Drop the inputs; the module has one call fewer awaiting its gradient (on a record
        whose ``__init__`` never ran, ``__del__`` catches the missing attribute)."""
        if self.args is not None:
            self.args = self.kwargs = self.shared = self.sites = None
            self.extended.live -= 1

    def __del__(self):
        try:
            self.release()
        except Exception:  # noqa: BLE001  (interpreter shutdown: never print from __del__)
            pass

    def shaped(self, index: int, grad, columns: bool = False):
        """``grad`` read at the anchor of output ``index`` (see :func:`anchor`) in the output's
        shape (``[k, *anchor] -> [k, *out]`` for ``columns``)."""
        shape = self.out_shapes[index]
        if grad is None or grad.shape[int(columns) :] == shape:
            return grad
        return grad.reshape(*grad.shape[: int(columns)], *shape)


def _one_column(columns):
    """The first column of ``columns`` (a tensor, or a tuple of them and ``None``s): a
    ``grad_out`` of the per-sample shape (:meth:`Record.column_call`)."""
    if isinstance(columns, torch.Tensor):
        return columns[0]
    return tuple(None if c is None else c[0] for c in columns)


#: key of the autograd-node metadata marking the output node of an extended loss's call
_LOSS_METADATA = "curvopt_loss"


def mark_extended_loss(t: torch.Tensor) -> None:
    """Note on ``t``'s node that an extended loss module computed ``t`` (see
    :func:`is_extended_loss`)."""
    t.grad_fn.metadata[_LOSS_METADATA] = True


def is_extended_loss(node) -> bool:
    """Whether ``node`` produced the output of an extended loss module's call (its record is
    hooked there already)."""
    return node.metadata.get(_LOSS_METADATA, False)


class LossRecord:
    """One call of an extended loss: its input and target until the backward pass starts.
    ``no_hessian``: why ``DiagHessian`` cannot use it (a loss read from the graph whose input
    is not its Hessian's: ``recognize``), else None."""

    __slots__ = ("module", "args", "kwargs", "no_hessian")

    def __init__(self, module, args, kwargs, no_hessian=None):
        self.module, self.args, self.kwargs = module, args, kwargs
        self.no_hessian = no_hessian

    @property
    def output(self) -> torch.Tensor:
        return self.args[0]

    @property
    def target(self):
        return self.args[1] if len(self.args) > 1 else self.kwargs["target"]


def _parameter_precision(module: nn.Module, compute: torch.dtype):
    """``(compute, accumulate)`` when ``module`` computed in a dtype other than its parameters'
    (``compute``, its output's dtype: autocast), else ``None``."""
    for p in module._parameters.values():  # (a loop: a generator costs a call per step)
        if p is not None:
            break
    else:  # parameters of children only (a rule owning them)
        p = next(module.parameters(), None)
    if p is None or p.dtype == compute or not p.is_floating_point():
        return None
    return compute, p.dtype


def _cast(value, compute: torch.dtype, accumulate: torch.dtype):
    """Every floating tensor in ``value`` rounded to ``compute``, then cast to ``accumulate``."""
    if isinstance(value, torch.Tensor):
        if not value.is_floating_point():
            return value
        return value.to(compute).to(accumulate)
    if isinstance(value, (tuple, list)):
        return type(value)(_cast(v, compute, accumulate) for v in value)
    if isinstance(value, dict):
        return {k: _cast(v, compute, accumulate) for k, v in value.items()}
    return value
