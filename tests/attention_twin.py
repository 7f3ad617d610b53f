"""The twin of an ``nn.MultiheadAttention``: the same function written with ``nn.Linear``
projections and explicit softmax attention, for references (``docs/conventions.md``: the
attention's factor layout).

``qkv = nn.Linear(E, 3E)`` is applied once to the positions it projects, as the contract lays
``in_proj_weight`` out: the query positions alone when query, key and value are one tensor;
else the query positions, then the key positions (key and value one tensor), then the value
positions, each read only in its own block of the output. ``out = nn.Linear(E, E)`` is
``out_proj``. Separate ``q/k/v_proj_weight`` (``kdim``/``vdim``) are three ``nn.Linear``.
No dropout, ``add_bias_kv`` or ``add_zero_attn``: the references run with neither.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn


class TwinAttention(nn.Module):
    def __init__(self, mha: nn.MultiheadAttention):
        super().__init__()
        assert mha.bias_k is None and not mha.add_zero_attn and mha.dropout == 0
        e = self.embed_dim = mha.embed_dim
        self.heads, self.batch_first = mha.num_heads, mha.batch_first
        bias = mha.in_proj_bias is not None
        dtype = mha.out_proj.weight.dtype
        self.packed = mha._qkv_same_embed_dim
        with torch.no_grad():
            if self.packed:
                self.qkv = nn.Linear(e, 3 * e, bias=bias, dtype=dtype)
                self.qkv.weight.copy_(mha.in_proj_weight)
            else:
                self.q = nn.Linear(e, e, bias=bias, dtype=dtype)
                self.k = nn.Linear(mha.kdim, e, bias=bias, dtype=dtype)
                self.v = nn.Linear(mha.vdim, e, bias=bias, dtype=dtype)
                for lin, w in zip((self.q, self.k, self.v), (mha.q_proj_weight, mha.k_proj_weight,
                                                             mha.v_proj_weight)):
                    lin.weight.copy_(w)
                if bias:
                    for lin, b in zip((self.q, self.k, self.v), mha.in_proj_bias.chunk(3)):
                        lin.bias.copy_(b)
            if bias and self.packed:
                self.qkv.bias.copy_(mha.in_proj_bias)
            self.out = nn.Linear(e, e, bias=mha.out_proj.bias is not None, dtype=dtype)
            self.out.weight.copy_(mha.out_proj.weight)
            if mha.out_proj.bias is not None:
                self.out.bias.copy_(mha.out_proj.bias)

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True,
                attn_mask=None, average_attn_weights=True, is_causal=False):
        sharing = "self" if (key is value and query is key) else ("kv" if key is value else "none")
        seq = 1 if self.batch_first else 0  # the projections run in the model's own layout
        length, span, e = query.shape[seq], key.shape[seq], self.embed_dim
        if not self.packed:
            q, k, v = self.q(query), self.k(key), self.v(value)
        elif sharing == "self":
            q, k, v = self.qkv(query).chunk(3, -1)
        elif sharing == "kv":
            proj = self.qkv(torch.cat([query, key], seq))
            q = proj.narrow(seq, 0, length)[..., :e]
            k = proj.narrow(seq, length, span)[..., e:2 * e]
            v = proj.narrow(seq, length, span)[..., 2 * e:]
        else:
            proj = self.qkv(torch.cat([query, key, value], seq))
            q = proj.narrow(seq, 0, length)[..., :e]
            k = proj.narrow(seq, length, span)[..., e:2 * e]
            v = proj.narrow(seq, length + span, span)[..., 2 * e:]
        if not self.batch_first:
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        n = q.shape[0]
        d = e // self.heads
        q, k, v = (t.reshape(n, -1, self.heads, d).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d)
        scores = scores + _additive(attn_mask, scores, n, self.heads)
        if key_padding_mask is not None:
            scores = scores + _additive(key_padding_mask[:, None, None, :], scores, n, self.heads)
        weights = scores.softmax(-1)
        o = (weights @ v).transpose(1, 2).reshape(n, length, e)
        y = self.out(o if self.batch_first else o.transpose(0, 1))
        if not need_weights:
            return y, None
        return y, weights.mean(1) if average_attn_weights else weights


def _additive(mask, scores, n, heads):
    """A boolean (True: masked) or additive mask as the additive ``[N, H, L, S]`` term."""
    if mask is None:
        return 0.0
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=scores.dtype).masked_fill(mask, float("-inf"))
    if mask.dim() == 3:  # [N * heads, L, S]
        mask = mask.reshape(n, heads, *mask.shape[1:])
    return mask


def with_twins(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every ``nn.MultiheadAttention`` replaced by its twin."""
    model = copy.deepcopy(model)
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.MultiheadAttention):
                setattr(module, child_name, TwinAttention(child))
    return model


def twin_names(model: nn.Module) -> dict:
    """``twin parameter name -> the attention's parameter name`` for :func:`with_twins`."""
    names = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.MultiheadAttention):
            prefix = f"{name}." if name else ""
            names.update({
                f"{prefix}qkv.weight": f"{prefix}in_proj_weight",
                f"{prefix}qkv.bias": f"{prefix}in_proj_bias",
                f"{prefix}q.weight": f"{prefix}q_proj_weight",
                f"{prefix}k.weight": f"{prefix}k_proj_weight",
                f"{prefix}v.weight": f"{prefix}v_proj_weight",
                f"{prefix}out.weight": f"{prefix}out_proj.weight",
                f"{prefix}out.bias": f"{prefix}out_proj.bias",
            })
    return names
