"""``nn.MultiheadAttention``: the generic rule (``generic``), with its inputs and outputs named."""

from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.func import functional_call

from curvopt.layers.generic import GenericRule
from curvopt.layers.registry import register


@register(nn.MultiheadAttention)
class MultiheadAttentionRule(GenericRule):
    """Attention calls its projections functionally, so the rule owns ``out_proj`` too."""

    owns_children = True

    def batch_dim(self, module):
        return 0 if module.batch_first else 1

    def check(self, module):
        if module.training and module.dropout > 0:
            return (
                "attention dropout in training mode cannot be re-run sample by sample; "
                "call .eval() or set dropout=0"
            )
        return None

    def sample_inputs(self, call):
        """Inputs by name: ``query``/``key``/``value`` are batched along ``batch_dim``,
        ``key_padding_mask`` (``[N, S]``) along 0, a 3-D ``attn_mask`` (``[N * heads, L, S]``)
        is viewed as ``[N, heads, L, S]``; a 2-D ``attn_mask`` is shared by all samples."""
        module, n = call.module, call.batch_size
        kwargs = dict(inspect.signature(module.forward).bind(*call.args, **call.kwargs).arguments)
        mask = kwargs.get("attn_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 3:
            kwargs["attn_mask"] = mask.reshape(n, -1, *mask.shape[1:])
        bd = self.batch_dim(module)
        by_name = {"query": bd, "key": bd, "value": bd, "key_padding_mask": 0, "attn_mask": 0}
        dims = []
        for name, value in kwargs.items():
            d = by_name.get(name)
            if name == "attn_mask" and isinstance(value, torch.Tensor) and value.dim() != 4:
                d = None
            dims.append(d if isinstance(value, torch.Tensor) else None)
        return (), kwargs, dims

    def output_dims(self, call, count):
        # attn_output follows batch_first; the attention weights are always [N, ...]
        return [self.batch_dim(call.module), 0][:count]

    def rerun(self, module, params, args, kwargs):
        mask = kwargs.get("attn_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 4:
            kwargs = {**kwargs, "attn_mask": mask.flatten(0, 1)}
        return functional_call(module, params, args, kwargs)
