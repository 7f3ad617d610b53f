"""The random numbers of a module's forward, for re-running it sample by sample.

A module in training mode draws its dropout masks (and its other random numbers: stochastic
depth's ``x.new_empty(shape).bernoulli_(keep)``) in the forward; they are part of the function
(``docs/conventions.md``). A rule that re-runs the module one sample at a time (``generic``)
must use the draws of the forward, not draw new ones. They are read in three steps:

1. :class:`DrawnMasks`: a forward of the whole batch from the generator state the recorded
   forward started from (``Call.random``) draws what it drew. Each dropout is answered by
   ``x * m`` with ``m = dropout(ones_like(x))``, the same draw (a dropout's draw depends on the
   shape, dtype and device of its input only, not on its values), so the multipliers ``m``
   (``0`` or ``1/(1-p)``) are kept in call order; each other random op (:data:`DRAWS`) runs
   as it is and its result is kept in the same order;
2. :func:`per_sample`: each draw ``[*, N s_d, *]`` is split at the one dim where the batch
   is (``s`` the shape the same op draws in a forward of one sample, read by a forward of
   sample 0 in :class:`MaskShapes`, which draws nothing), ``[N, *s]``; a draw whose shape does
   not depend on the batch (``StochasticDepth(mode="batch")``, a dropout of a parameter) is
   shared by all samples, ``[N, *s]`` by repetition;
3. :class:`ReplayedMasks`: in the sample-by-sample re-run, the ``i``-th dropout is answered by
   ``x * m_i`` and the ``i``-th other random op by (a copy of) ``m_i``, that sample's draw.

Dropouts: ``F.dropout``, ``F.dropout1d/2d/3d`` (``nn.Dropout*``, functional calls alike), the
attention dropout of ``F.scaled_dot_product_attention`` (``dropout_p > 0``), answered by the
reference formula of its documentation with the multiplier on the attention weights
``[B, H, L, S]``, and that of ``F.multi_head_attention_forward`` (``nn.MultiheadAttention``;
torch runs its inner calls past any mode, so it is answered whole): its attention weights
per head without dropout, times the multiplier ``[N H, L, S]``, applied to the heads' values
and ``out_proj``. These are the draws torch's own kernels make on the CPU (one Bernoulli draw
over the weights' elements). Other random ops (:data:`DRAWS`): ``Tensor.bernoulli_``,
``bernoulli``, ``rand``, ``rand_like``, ``randn``, ``randn_like``, ``Tensor.uniform_``,
``Tensor.normal_`` (elementwise draws: each element of a batch-shaped draw belongs to one
sample); the re-run takes the op's result for the draw (a forward that reads the tensor an
in-place op drew into, not its result, re-runs with other numbers and fails the sum check).
Alpha dropout is not multiplicative, a permutation or a sampled index (:data:`NOT_REPLAYED`)
mixes samples, and a draw from a generator of the user's is not the one the recorded state
replays: each raises (:class:`ReplayError`), naming the op. A forward whose draws differ from
the recorded one is caught by the engine's sum check (``sum_n g_n == p.grad``), never silently.
"""

from __future__ import annotations

import inspect
import math
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_MULTIPLICATIVE = (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d)
_NOT_REPLAYED = (F.alpha_dropout, F.feature_alpha_dropout)


class ReplayError(RuntimeError):
    """A random op of the forward that cannot be replayed sample by sample."""


#: the keyword arguments of a random op that a stand-in of the same shape takes
_LAYOUT = ("dtype", "layout", "device", "pin_memory", "requires_grad", "memory_format")


def _layout(kwargs) -> dict:
    return {k: v for k, v in kwargs.items() if k in _LAYOUT}


def _in_place(value: float):
    return lambda args, kwargs: args[0].fill_(value)


def _like(value: float):
    return lambda args, kwargs: torch.full_like(args[0], value, **_layout(kwargs))


def _factory(value: float):
    return lambda args, kwargs: torch.empty(*args, **_layout(kwargs)).fill_(value)


#: the elementwise random ops replayed like dropout, each with its stand-in: a tensor of the
#: shape it draws, drawn from nothing (a forward of sample 0 reads the shapes, ``MaskShapes``)
DRAWS = {
    torch.Tensor.bernoulli_: _in_place(1.0),
    torch.Tensor.bernoulli: _like(1.0),
    torch.bernoulli: _like(1.0),
    torch.rand: _factory(0.5),
    torch.rand_like: _like(0.5),
    torch.randn: _factory(0.0),
    torch.randn_like: _like(0.0),
    torch.Tensor.uniform_: _in_place(0.5),
    torch.Tensor.normal_: _in_place(0.0),
}

#: random ops not replayed: an index or permutation mixes samples, the others are not answered
NOT_REPLAYED = (
    torch.randperm,
    torch.multinomial,
    torch.Tensor.multinomial,
    torch.randint,
    torch.randint_like,
    torch.normal,
    torch.poisson,
    torch.Tensor.random_,
    torch.Tensor.exponential_,
    torch.Tensor.geometric_,
    torch.Tensor.cauchy_,
    torch.Tensor.log_normal_,
)


def _ones(x: torch.Tensor) -> torch.Tensor:
    """A dropout's stand-in: ones of ``x``'s shape, one element in memory."""
    return x.new_ones(()).expand(x.shape)


def op_name(func) -> str:
    """``torch.rand`` or ``Tensor.bernoulli_``: how a user writes the op ``func``."""
    owner = "Tensor" if getattr(func, "__objclass__", None) is not None else "torch"
    return f"{owner}.{func.__name__}"


def _dropout_args(args, kwargs):
    """``(input, p, training, inplace)`` of a ``F.dropout*`` call."""
    names = ("input", "p", "training", "inplace")
    defaults = {"p": 0.5, "training": True, "inplace": False}
    bound = {**defaults, **dict(zip(names, args)), **kwargs}
    return bound["input"], bound["p"], bound["training"], bound["inplace"]


def _attention_args(args, kwargs):
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    defaults = {
        "attn_mask": None,
        "dropout_p": 0.0,
        "is_causal": False,
        "scale": None,
        "enable_gqa": False,
    }
    return {**defaults, **dict(zip(names, args)), **kwargs}


def _attention_weights(a) -> torch.Tensor:
    """``softmax(q kᵀ · scale + bias)``, ``[*, H, L, S]``, of the documented reference."""
    q, k = a["query"], a["key"]
    length, span = q.shape[-2], k.shape[-2]
    scale = 1 / math.sqrt(q.shape[-1]) if a["scale"] is None else a["scale"]
    if a["enable_gqa"]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
    scores = q @ k.transpose(-2, -1) * scale
    if a["is_causal"]:
        keep = torch.ones(length, span, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    mask = a["attn_mask"]
    if mask is not None:
        scores = (
            scores.masked_fill(~mask, float("-inf"))
            if mask.dtype == torch.bool
            else (scores + mask)
        )
    return scores.softmax(-1)


def _attend(a, weights) -> torch.Tensor:
    v = a["value"]
    if a["enable_gqa"]:
        v = v.repeat_interleave(weights.shape[-3] // v.shape[-3], -3)
    return weights @ v


_MHA_SIGNATURE = inspect.signature(F.multi_head_attention_forward)


def _heads_values(a) -> torch.Tensor:
    """``F.multi_head_attention_forward``'s values per head ``[N H, S, E / H]`` (projected,
    ``bias_v`` and the zero attention row appended), sequence-first inputs."""
    value, e, heads = a["value"], a["embed_dim_to_check"], a["num_heads"]
    if value.dim() != 3 or a["static_v"] is not None:
        raise ReplayError("attention dropout of unbatched inputs or static_v is not replayed")
    weight = a["v_proj_weight"] if a["use_separate_proj_weight"] else a["in_proj_weight"][2 * e :]
    bias = None if a["in_proj_bias"] is None else a["in_proj_bias"][2 * e :]
    v = F.linear(value, weight, bias)
    n = v.shape[1]
    if a["bias_v"] is not None:
        v = torch.cat([v, a["bias_v"].repeat(1, n, 1)])
    v = v.reshape(v.shape[0], n * heads, e // heads).transpose(0, 1)
    if a["add_zero_attn"]:
        v = torch.cat([v, v.new_zeros(n * heads, 1, e // heads)], 1)
    return v


def _attention_layer(a, multiplier_of):
    """``F.multi_head_attention_forward`` with its attention dropout answered by
    ``multiplier_of(weights)`` (``weights [N H, L, S]`` of all heads, before dropout)."""
    _, weights = F.multi_head_attention_forward(
        **{**a, "dropout_p": 0.0, "need_weights": True, "average_attn_weights": False}
    )
    n, heads, length = weights.shape[0], weights.shape[1], weights.shape[2]
    dropped = weights.flatten(0, 1) * multiplier_of(weights.flatten(0, 1))
    o = torch.bmm(dropped, _heads_values(a)).transpose(0, 1).reshape(length * n, -1)
    out = F.linear(o, a["out_proj_weight"], a["out_proj_bias"]).view(length, n, -1)
    if not a["need_weights"]:
        return out, None
    dropped = dropped.view(n, heads, length, -1)
    return out, dropped.mean(1) if a["average_attn_weights"] else dropped


class _DropoutMode(TorchFunctionMode):
    """Answers each random op with :meth:`answer` (``i``: its call order among the forward's
    random ops): a dropout by ``x * answer(...)``, any other draw (:data:`DRAWS`) by
    ``answer(...)`` itself."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def answer(self, index: int, name: str, draw, stand_in) -> torch.Tensor:
        """The draw ``index`` (``name``: its op): ``draw()`` makes it as the forward did,
        ``stand_in()`` is a tensor of its shape drawn from nothing."""
        raise NotImplementedError

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _NOT_REPLAYED and _dropout_args(args, kwargs)[2]:
            raise ReplayError(f"{func.__name__} in training mode is not replayed sample by sample")
        if func in NOT_REPLAYED:
            raise ReplayError(f"{op_name(func)} is not replayed sample by sample")
        if func in DRAWS:
            name = op_name(func)
            if kwargs.get("generator") is not None:
                raise ReplayError(f"{name} draws from a generator of its own, not replayed")
            return self.answer(
                self._next(),
                name,
                lambda: func(*args, **kwargs),
                lambda: DRAWS[func](args, kwargs),
            )
        if func in _MULTIPLICATIVE:
            x, p, training, inplace = _dropout_args(args, kwargs)
            if training and p > 0:
                m = self._dropout(func.__name__, x, lambda: func(torch.ones_like(x), p, True))
                return x.mul_(m) if inplace else x * m
        if func is F.scaled_dot_product_attention:
            a = _attention_args(args, kwargs)
            if a["dropout_p"] > 0:
                weights = _attention_weights(a)
                m = self._dropout(
                    "scaled_dot_product_attention",
                    weights,
                    lambda: F.dropout(torch.ones_like(weights), a["dropout_p"], True),
                )
                return _attend(a, weights * m)
        if func is F.multi_head_attention_forward:
            bound = _MHA_SIGNATURE.bind(*args, **kwargs)
            bound.apply_defaults()
            a = dict(bound.arguments)
            if a["training"] and a["dropout_p"] > 0:
                index = self._next()
                return _attention_layer(
                    a,
                    lambda w: self.answer(
                        index,
                        "multi_head_attention_forward",
                        lambda: F.dropout(torch.ones_like(w), a["dropout_p"], True),
                        lambda: _ones(w),
                    ),
                )
        return func(*args, **kwargs)

    def _dropout(self, name: str, x: torch.Tensor, draw) -> torch.Tensor:
        return self.answer(self._next(), name, draw, lambda: _ones(x))

    def _next(self) -> int:
        self.count += 1
        return self.count - 1


class DrawnMasks(_DropoutMode):
    """Step 1: the draws of a forward of the whole batch, drawn as the forward drew them (run
    it from the recorded generator state), and the names of their ops."""

    def __init__(self):
        super().__init__()
        self.masks: List[torch.Tensor] = []
        self.names: List[str] = []

    def answer(self, index, name, draw, stand_in):
        value = draw()
        self.masks.append(value.clone())  # the forward may change its draw in place (``div_``)
        self.names.append(name)
        return value


class MaskShapes(_DropoutMode):
    """The shapes each random op draws in a forward of one sample (nothing is drawn)."""

    def __init__(self):
        super().__init__()
        self.shapes: List[torch.Size] = []

    def answer(self, index, name, draw, stand_in):
        value = stand_in()
        self.shapes.append(value.shape)
        return value


class ReplayedMasks(_DropoutMode):
    """Step 3: each random op answered by its draw for the sample (``masks``, in call
    order; inside ``vmap`` over samples, each a sample's slice)."""

    def __init__(self, masks: Sequence[torch.Tensor]):
        super().__init__()
        self.masks = masks

    def answer(self, index, name, draw, stand_in):
        if index >= len(self.masks):
            raise ReplayError(f"the re-run draws more than the forward drew ({name})")
        value, shape = self.masks[index], stand_in().shape
        if value.shape != shape:
            raise ReplayError(
                f"{name} draws {tuple(shape)} per sample in the re-run, the forward "
                f"{tuple(value.shape)}"
            )
        return value.clone()


def per_sample(
    masks: Sequence[torch.Tensor],
    shapes: Sequence[torch.Size],
    n: int,
    path: str,
    names: Sequence[str],
) -> List[torch.Tensor]:
    """Step 2: each batch draw ``[*, N s_d, *]`` as ``[N, *s]`` (``shapes``: what one sample's
    forward draws; ``names``: the ops that drew them), the batch split off the one dim where
    the shapes differ; a draw of the same shape for one sample as for the batch is shared."""
    if len(masks) != len(shapes):
        raise ReplayError(
            f"module {path!r} drew {len(masks)} random tensors for the batch but {len(shapes)} "
            "for one sample"
        )
    result = []
    for mask, shape, name in zip(masks, shapes, names):
        if mask.shape == shape:  # the draw does not depend on the batch: each sample's
            result.append(mask.unsqueeze(0).expand(n, *shape))
            continue
        dim = _batch_dim(mask.shape, shape, n)
        if dim is None:
            raise ReplayError(
                f"module {path!r} draws a tensor of shape {tuple(mask.shape)} for the batch "
                f"and {tuple(shape)} for one sample with {name}, which does not split into its "
                f"{n} samples"
            )
        split = mask.unflatten(dim, (n, shape[dim]))
        result.append(split.movedim(dim, 0))
    return result


def _batch_dim(batch: torch.Size, one: torch.Size, n: int) -> Optional[int]:
    if len(batch) != len(one):
        return None
    differ = [d for d, (a, b) in enumerate(zip(batch, one)) if a != b]
    if len(differ) == 1 and batch[differ[0]] == n * one[differ[0]]:
        return differ[0]
    return None
