"""What curvopt reads from torch's internals: the autograd node names it branches on, and the
private accessors it calls (the re-run of a reentrant checkpoint is ``torch_rerun``'s, the
second derivatives read off nodes ``second_derivatives``'s). ``tests/test_torch_internals.py``
builds small graphs and checks that each name and accessor still exists in the installed torch.

Node names are the class names of autograd nodes (``type(tensor.grad_fn).__name__``).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Callable, Optional

import torch
import torch.utils.checkpoint
from torch.autograd import Variable
from torch.utils.hooks import RemovableHandle

# ----------------------------------------------------------------------------- accessors
# The accessors read in every hook of a pass are torch's own functions under curvopt's names,
# not wrappers (a Python call fewer at each read).

#: ``current_graph_task_id()``: the id of the autograd task (backward run) now executing on
#: this thread, ``-1`` outside
current_graph_task_id = torch._C._current_graph_task_id

#: ``current_autograd_node()``: the autograd node whose hook is running now, or ``None``
#: outside a backward pass
current_autograd_node = torch._C._current_autograd_node

#: ``will_engine_execute_node(node)``: whether the running backward pass will execute ``node``
#: (raises ``RuntimeError`` for a node that is an input of ``torch.autograd.grad``)
will_engine_execute_node = torch._C._will_engine_execute_node


def queue_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the running backward pass ends."""
    Variable._execution_engine.queue_callback(fn)


#: ``any_autocast_enabled()``: whether autocast is on for any device type (one read, where
#: asking ``cpu`` and ``cuda`` each is two)
any_autocast_enabled = torch._C._is_any_autocast_enabled


#: the engine's backward as ``torch.autograd.grad`` runs it (``_engine_run_backward``: with what
#: ``grad`` does around the engine, its debug logging and the caller's context stashed for the
#: device threads); before torch 2.3, which has no such function, ``grad`` runs the engine itself
_run_backward = getattr(
    torch.autograd.graph, "_engine_run_backward", Variable._execution_engine.run_backward
)


def batched_vjp(outputs: tuple, inputs: tuple, columns: tuple) -> tuple:
    """``torch.autograd.grad(outputs, inputs, columns, retain_graph=True, allow_unused=True,
    is_grads_batched=True)`` (``outputs``, ``inputs``: tensors or gradient edges; ``columns``
    ``[k, *output]`` each, plain tensors): the same steps, the engine's backward run once
    over the columns batched along dim 0 at a fresh level of torch's ``vmap`` and the results
    unbatched (``None`` for an input not reached), without the argument checks and the tree
    flattening of ``grad``'s ``vmap`` (about 200 Python calls a call). The engine checks the
    columns' shapes against the outputs'; an op without a batching rule raises as it does
    under ``grad``."""
    level = torch._C._vmapmode_increment_nesting()
    try:
        batched = tuple(torch._add_batch_dim(c, 0, level) for c in columns)
        found = _run_backward(outputs, batched, True, False, inputs, True, accumulate_grad=False)
        k = columns[0].shape[0]
        return tuple(None if g is None else torch._remove_batch_dim(g, level, k, 0) for g in found)
    finally:
        torch._C._vmapmode_decrement_nesting()


def hook_gradient(t: torch.Tensor, hook: Callable) -> None:
    """``t.register_hook(hook)`` for good, without the removal handle (``RemovableHandle``,
    and the import ``Tensor.register_hook`` runs on every call: two thirds of its cost): the
    same steps otherwise, so ``hook`` runs where ``register_hook`` would put it, after the hooks
    registered before it and before those registered after it. Keyed by ``hook`` itself in
    ``t._backward_hooks`` (torch keys by its handles' integer ids, so no key is shared; ``hook``
    must be a fresh object, a closure). A tensor subclass (``__torch_function__``) or a tensor
    that requires no gradient goes through ``register_hook`` itself."""
    if type(t) is not torch.Tensor or not t.requires_grad:
        t.register_hook(hook)
        return
    hooks = t._backward_hooks
    if hooks is None:
        t._backward_hooks = hooks = OrderedDict()
        if t.grad_fn is not None:
            t.grad_fn._register_hook_dict(t)
    hooks[hook] = hook


def drop_empty_tensor_hooks(t: torch.Tensor) -> None:
    """Once the last hook of ``t`` is removed, take its hook dispatcher off too: autograd still
    calls into the empty ``t._backward_hooks`` dict on every backward; ``None``, which a tensor
    never hooked has, clears it (the assignment resets the tensor's hooks in C++)."""
    if t._backward_hooks is not None and not t._backward_hooks:
        t._backward_hooks = None


class TakenOff:
    """A hook taken out of torch's hook dicts (:func:`take_off`), to go back where it was
    (:func:`put_back`): its key and function, the keys that came before it in its dict, and
    the extra dicts (``with_kwargs``) that held its key."""

    __slots__ = ("key", "hook", "before", "extras")

    def __init__(self, key, hook, before: frozenset, extras: tuple):
        self.key, self.hook, self.before, self.extras = key, hook, before, extras


def take_off(handle) -> Optional[TakenOff]:
    """Take the hook of ``handle`` (a ``RemovableHandle``) out of its dict and extra dicts
    without dropping it; None where it is not in its dict (removed already)."""
    hooks = handle.hooks_dict_ref()
    if hooks is None or handle.id not in hooks:
        return None
    keys = list(hooks)
    before = frozenset(keys[: keys.index(handle.id)])
    hook = hooks.pop(handle.id)
    extras = []
    for ref in handle.extra_dict_ref:
        extra = ref()
        if extra is not None and handle.id in extra:
            extras.append((ref, extra.pop(handle.id)))
    return TakenOff(handle.id, hook, before, tuple(extras))


def put_back(hooks: dict, taken: TakenOff, key=None) -> None:
    """Insert ``taken``'s hook into ``hooks`` (under ``key``, default its own) where it would
    be had it never been taken off: after the last hook that came before it then and is still
    there; the hooks registered since (appended: after it; ``prepend=True``: before it) and
    those that followed it keep their places relative to it."""
    keys = list(hooks)
    key = taken.key if key is None else key
    hooks[key] = taken.hook
    last = max((i for i, k in enumerate(keys) if k in taken.before), default=-1)
    for k in keys[last + 1 :]:  # behind it again, in their order
        hooks[k] = hooks.pop(k)
    for ref, value in taken.extras:
        extra = ref()
        if extra is not None:
            extra[key] = value


def take_off_tensor_hook(t: torch.Tensor, handle) -> Optional[TakenOff]:
    """:func:`take_off` of a tensor hook; once ``t`` has no hook left, its dispatcher goes too
    (:func:`drop_empty_tensor_hooks`): the backward then calls nothing of Python for ``t``."""
    taken = take_off(handle)
    drop_empty_tensor_hooks(t)
    return taken


def put_back_tensor_hook(t: torch.Tensor, taken: TakenOff) -> RemovableHandle:
    """Hook ``t`` with ``taken``'s hook again, where it was among ``t``'s hooks (:func:`put_back`),
    by ``Tensor.register_hook``'s steps (which refuse a tensor frozen meanwhile, and import
    at every call: also at the interpreter's exit, where a weakref callback may put hooks
    back); the new handle is returned (the old one's dict may be gone:
    :func:`take_off_tensor_hook`)."""
    hooks = t._backward_hooks
    if hooks is None:
        t._backward_hooks = hooks = OrderedDict()  # (the assignment hands autograd the dict)
        if t.grad_fn is not None:
            t.grad_fn._register_hook_dict(t)
    handle = RemovableHandle(hooks)
    put_back(hooks, taken, handle.id)
    return handle


def storage_use_count(storage) -> int:
    """References held to the ``StorageImpl`` of an untyped storage."""
    return torch._C._storage_Use_Count(storage._cdata)


def input_shape(node, index: int):
    """Shape of the ``index``-th input of an autograd node (that of its output gradient)."""
    return tuple(node._input_metadata[index].shape)


def backward_with_graph(node, grads: tuple) -> tuple:
    """``node``'s backward applied to ``grads`` with its own graph recorded (grad enabled): the
    gradients for its inputs as differentiable functions of what it saved."""
    with torch.enable_grad():
        result = node(*grads)
    return result if isinstance(result, tuple) else (result,)


def ones_of_input(node, index: int) -> torch.Tensor:
    """Ones of the shape, dtype and device of ``node``'s ``index``-th input (output gradient)."""
    meta = node._input_metadata[index]
    return torch.ones(tuple(meta.shape), dtype=meta.dtype, device=meta.device)


def grad_accumulator(p: torch.Tensor):
    """The ``AccumulateGrad`` node of a leaf tensor ``p`` (that of a view of it points there)."""
    with torch.enable_grad():
        return p.view_as(p).grad_fn.next_functions[0][0]


#: torch's ``GraphExecGroup`` (torch 2.10 on; ``None`` before): backward runs under one of them
#: share the recomputation of each ``use_reentrant=False`` checkpoint region
_GRAPH_EXEC_GROUP = getattr(torch.utils.checkpoint, "GraphExecGroup", None)


class SavedTensorsApart:
    """Read autograd nodes' saved tensors during a backward pass apart from it.

    Inside a ``use_reentrant=False`` checkpoint a saved tensor is recomputed when first read,
    and each read of it per backward run (per graph task, or per ``GraphExecGroup``) releases
    it: a read in a hook of the running backward would leave torch's own backward nothing
    (``CheckpointError``, "already unpacked once"). ``with apart: node._saved_result`` reads
    under a group of its own instead, so the checkpointed region is recomputed once for all
    the reads under the same object, and torch's backward recomputes it again for its own.
    Without ``GraphExecGroup`` (torch before 2.10), or inside a group the caller entered
    (groups do not nest), reads run as they are (outside checkpoints that is all there is).
    """

    def __init__(self):
        self._group = None if _GRAPH_EXEC_GROUP is None else _GRAPH_EXEC_GROUP()
        self._entered = False

    def __enter__(self):
        self._entered = self._group is not None and torch._C._get_graph_exec_group() is None
        if self._entered:
            self._group.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._entered:
            self._group.__exit__(*exc)


def add_alpha(node) -> float:
    """The ``alpha`` of ``AddBackward0`` (``a + alpha * b``)."""
    return float(node._saved_alpha)


def max_pool_transpose(node, columns: torch.Tensor) -> torch.Tensor:
    """``J^T`` of the max pooling of ``node`` (a ``MAX_POOL`` node) on ``columns`` ``[k, *out]``:
    ``[k, *in]``, each column's entries added at the input positions of their window's maximum
    (the saved indices, flat within each input plane; added, as overlapping windows share
    maxima), all ``k`` columns in one ``scatter_add``."""
    dims = MAX_POOL[type(node).__name__]
    indices = node._saved_result1.flatten(-dims)  # [*batch, channels, out positions]
    shape = node._saved_self.shape
    k = columns.shape[0]
    out = columns.new_zeros(k, *shape[:-dims], math.prod(shape[-dims:]))
    out.scatter_add_(-1, indices.expand(k, *indices.shape), columns.flatten(-dims))
    return out.view(k, *shape)


def pad_transpose(node, columns: torch.Tensor) -> torch.Tensor:
    """``J^T`` of the constant padding of ``node`` (a ``CONSTANT_PAD`` node, ``F.pad`` or
    ``nn.ZeroPad2d``) on ``columns`` ``[k, *out]``: ``[k, *in]``, the padded borders cut off
    (a negative pad, a crop, comes back as zeros). The pad acts on the trailing dims only, so
    all ``k`` columns go at once, exactly (entries are moved, never summed)."""
    return torch.constant_pad_nd(columns, [-p for p in saved(node, "pad")])


# ----------------------------------------------------------------------------- node names

#: the leaf node of a tensor that requires grad (``node.variable`` is the tensor)
ACCUMULATE_GRAD = "AccumulateGrad"

#: ops that only change the shape of their input (their output has the input's elements)
SHAPE_OPS = {"UnsqueezeBackward0", "ViewBackward0", "ReshapeAliasBackward0", "UnsafeViewBackward0"}
#: an in-place op on a view (``h.relu_()``, ``h += o`` for a view ``h``, e.g. a ``Linear``'s
#: output on ``[N, T, D]``): it wraps the op's backward, which Python cannot name
IN_PLACE_ON_VIEW = "CopySlices"
#: ``a + alpha * b`` (``add_alpha``)
ADD = "AddBackward0"
#: ops whose output gradient is the per-sample gradient of a broadcast operand
BROADCASTING_OPS = {ADD, "ExpandBackward0"}

#: ``h Wᵀ`` and ``b + h Wᵀ`` (``F.linear`` on ``[.., d]``, a matmul by a weight) -> the position
#: of ``h``'s edge: with every other edge empty, a frozen linear map of the rows of ``h``
FROZEN_PRODUCTS = {"MmBackward0": 0, "AddmmBackward0": 1}
#: max pooling (``F.max_pool1d`` runs as the 2-D op on ``[.., 1, L]``) -> its spatial dims; its
#: ``J^T`` is ``max_pool_transpose`` (the saved indices), all columns at once
MAX_POOL = {"MaxPool2DWithIndicesBackward0": 2, "MaxPool3DWithIndicesBackward0": 3}
#: constant padding (``F.pad``, ``nn.ZeroPad2d``): ``vmap`` runs its backward column by column
#: and stacks the results; ``pad_transpose`` crops all columns at once
CONSTANT_PAD = "ConstantPadNdBackward0"
#: backward ops that ``vmap`` runs sample by sample (no batching rule in PyTorch): graphs with
#: them propagate columns one at a time, which is faster than the vmap fallback; the max-pool
#: nodes among them are crossed by ``max_pool_transpose`` where the walk is known
NO_BATCHING_RULE = set(MAX_POOL) | {
    "ScaledDotProductFlashAttentionForCpuBackward0",
    "ScaledDotProductEfficientAttentionBackward0",
    "ScaledDotProductFlashAttentionBackward0",
}
#: ops that pick entries by data (boolean masks, index tensors): which rows of the loss belong
#: to which sample can change from batch to batch under the same graph structure
DATA_INDEXING = {
    "IndexBackward0",
    "MaskedSelectBackward0",
    "IndexSelectBackward0",
    "GatherBackward0",
    "TakeBackward0",
    "MaskedScatterBackward0",
}
#: ``torch.utils.checkpoint(use_reentrant=True)``: the segment's graph exists only while this
#: node runs (recomputed inside it), and it refuses ``torch.autograd.grad``; curvopt re-runs
#: the segment itself for curvature (``rerun_checkpoint``, ``curvopt.graph.checkpointing``)
REENTRANT_CHECKPOINT = "CheckpointFunctionBackward"
#: the backward nodes of custom ``torch.autograd.Function``\ s (a reentrant checkpoint's among
#: them): their backward is Python, which may run anything, a nested backward pass included
PYTHON_FUNCTION_NODE = torch.autograd.function.BackwardCFunction
#: backward nodes of graphs compiled by ``torch.compile``, whose ops columns cannot pass
COMPILED = {"CompiledFunctionBackward", "CompiledFunction"}

#: ops with zero second derivative (linear or piecewise linear) in every input (shape-only and
#: broadcasting ops among them)
LINEAR_OPS = (
    SHAPE_OPS
    | BROADCASTING_OPS
    | {
        "AddBackward1",
        "SubBackward0",
        "SubBackward1",
        "NegBackward0",
        "TBackward0",
        "PermuteBackward0",
        "TransposeBackward0",
        "TransposeBackward1",
        "SqueezeBackward0",
        "SqueezeBackward1",
        "SqueezeBackward2",
        "SqueezeBackward3",
        "CloneBackward0",
        "CatBackward0",
        "SplitBackward0",
        "SplitWithSizesBackward0",
        "SliceBackward0",
        "SelectBackward0",
        "IndexBackward0",
        "SumBackward0",
        "SumBackward1",
        "MeanBackward0",
        "MeanBackward1",
        "ReluBackward0",
        "ThresholdBackward0",
        "ThresholdBackward1",
        "LeakyReluBackward0",
        "LeakyReluBackward1",
        "HardtanhBackward0",
        "MaxPool2DWithIndicesBackward0",
        "MaxPool3DWithIndicesBackward0",
        "AvgPool2DBackward0",
        "AvgPool3DBackward0",
        "AdaptiveAvgPool2DBackward0",
        "AdaptiveAvgPool3DBackward0",
        "ConstantPadNdBackward0",
        "ReflectionPad1DBackward0",
        "ReflectionPad2DBackward0",
        "ReplicationPad2DBackward0",
        "MulBackward1",
        "DivBackward1",
        "NativeDropoutBackward0",
        "AccumulateGrad",
        "AsStridedBackward0",
        "StackBackward0",
        "UnbindBackward0",
        # views and copies: the no-op slice ``h[:, slice(0, None)]`` of a causal LM head, casts
        "AliasBackward0",
        "ToCopyBackward0",
        "DiagonalBackward0",
        "FlipBackward0",
        "RollBackward0",
        "RepeatBackward0",
        "IndexSelectBackward0",
        "GatherBackward0",
        "MaskedFillBackward0",
        "CumsumBackward0",
        "UnfoldBackward0",
        "Im2ColBackward0",
        "Col2ImBackward0",
        "PixelShuffleBackward0",
        "PixelUnshuffleBackward0",
        "ChannelShuffleBackward0",
        # interpolation: fixed weights on the input
        "UpsampleNearest1DBackward0",
        "UpsampleNearest2DBackward0",
        "UpsampleNearest3DBackward0",
        "UpsampleNearestExact1DBackward0",
        "UpsampleNearestExact2DBackward0",
        "UpsampleNearestExact3DBackward0",
        "UpsampleLinear1DBackward0",
        "UpsampleBilinear2DBackward0",
        "UpsampleBicubic2DBackward0",
        "UpsampleTrilinear3DBackward0",
        # selections and piecewise-linear functions
        "WhereBackward0",
        "AbsBackward0",
        "ClampBackward1",
        "ClampMinBackward0",
        "ClampMaxBackward0",
        "MaxBackward0",
        "MaxBackward1",
        "MinBackward0",
        "MinBackward1",
        "AmaxBackward0",
        "AminBackward0",
        "MaximumBackward0",
        "MinimumBackward0",
        "HardsigmoidBackward0",
        "SoftshrinkBackward0",
        "HardshrinkBackward0",
        "AdaptiveMaxPool2DBackward0",
        "AdaptiveMaxPool3DBackward0",
        "MaxUnpool2DBackward0",
        "MaxUnpool3DBackward0",
    }
)
#: products: linear when at most one operand depends on the parameters; ``prelu(u, a)`` is
#: piecewise linear in ``u`` and linear in ``a``, its cross derivative ``1[u < 0]`` pairs them
#: ``a / b`` of two tensors: linear in ``a``, curved in ``b``
DIVISION = "DivBackward0"
BILINEAR_OPS = {
    "MulBackward0",
    "DivBackward0",
    "MmBackward0",
    "BmmBackward0",
    "AddmmBackward0",
    "PreluKernelBackward0",
}

# ------------------------------------- losses computed functionally (``recognize``)

NLL_LOSS = "NllLossBackward0"
#: ``nll_loss`` of inputs ``[N, C, *d]`` (viewed as ``[N, C, H, W]`` where ``d`` is not 2-D)
NLL_LOSS_2D = "NllLoss2DBackward0"
VIEW = "ViewBackward0"
LOG_SOFTMAX = "LogSoftmaxBackward0"
MSE_LOSS = "MseLossBackward0"
BCE_WITH_LOGITS = "BinaryCrossEntropyWithLogitsBackward0"
#: scalar ops that combine loss terms linearly: sums, differences, products and quotients by
#: constants (``MulBackward0``/``DivBackward0`` only where the other operand needs no grad)
LOSS_COMBINATIONS = {
    "AddBackward0",
    "SubBackward0",
    "NegBackward0",
    "MulBackward0",
    "MulBackward1",
    "DivBackward0",
    "DivBackward1",
}
#: the ``reduction`` enum a loss node saves (``at::Reduction``)
REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


def saved(node, name: str):
    """The attribute ``name`` a node saved in the forward (a tensor, None, a number or a tuple
    of numbers; signed integers such as ``ignore_index``, ``dim`` or a negative pad come back
    from torch as unsigned 64-bit, and are returned signed)."""
    value = getattr(node, f"_saved_{name}")
    if isinstance(value, tuple):
        return tuple(_signed(v) for v in value)
    return _signed(value)


def _signed(value):
    if isinstance(value, int) and value >= 1 << 63:
        return value - (1 << 64)
    return value


#: views that merge leading dims and keep the last (``[N, T, C] -> [N·T, C]`` when contiguous)
ROW_VIEWS = {VIEW, "UnsafeViewBackward0", "ReshapeAliasBackward0"}
