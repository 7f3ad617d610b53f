"""Fallback for any module that owns parameters: ``torch.func`` over single samples.

For sample ``n`` the module is re-run functionally on ``x_n`` (a batch of one) and the
vector-Jacobian product with ``dL/dy_n`` gives ``g_n``; ``vmap`` batches this over samples.
Costs one extra forward per sample; registered rules are faster.

Inputs are split into samples along ``batch_dim`` for every tensor argument whose size there
equals ``N``; others (masks, shared tensors) are passed whole. Stochastic modules in training
mode (dropout) cannot be re-run identically, so they are rejected.
"""

from __future__ import annotations

from typing import Dict

import torch
from torch import nn
from torch.func import functional_call, vjp, vmap
from torch.utils._pytree import tree_flatten, tree_unflatten

from curvopt.layers.registry import LayerRule, register
from curvopt.state import STATE

_STOCHASTIC = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout)


def owned_parameters(module: nn.Module, owns_children: bool) -> Dict[str, nn.Parameter]:
    """The parameters a rule is responsible for, by (dotted) name."""
    if owns_children:
        return dict(module.named_parameters())
    return dict(module.named_parameters(recurse=False))


class GenericRule(LayerRule):
    def check(self, module):
        for sub_name, sub in module.named_modules():
            where = f" (submodule {sub_name!r})" if sub_name else ""
            if isinstance(sub, _STOCHASTIC) and sub.training and sub.p > 0:
                return (
                    f"it contains dropout in training mode{where}, which cannot be re-run "
                    "sample by sample; call .eval() on it or move the dropout outside the module"
                )
            if isinstance(sub, nn.modules.batchnorm._BatchNorm) and sub.training:
                return f"it contains BatchNorm in training mode{where}, which mixes samples"
        return None

    def batch_grad(self, call, name, out=None):
        if "generic" not in call.cache:
            call.cache["generic"] = self.batch_grads(call)
        result = call.cache["generic"][name]
        return result if out is None else out.copy_(result)

    def batch_grads(self, call) -> Dict[str, torch.Tensor]:
        """All owned parameters' per-sample gradients from one vmapped pass."""
        module, bd = call.module, call.batch_dim
        params = {
            k: p.detach()
            for k, p in owned_parameters(module, self.owns_children).items()
            if p.requires_grad
        }
        n = call.batch_size
        grad_out = call.grad_out if isinstance(call.grad_out, tuple) else (call.grad_out,)
        leaves, spec = tree_flatten((call.args, call.kwargs))
        batched = [
            isinstance(x, torch.Tensor) and x.dim() > bd and x.shape[bd] == n for x in leaves
        ]
        leaves = [x.detach() if isinstance(x, torch.Tensor) else x for x in leaves]
        const = [None if b else x for x, b in zip(leaves, batched)]
        sample_leaves = [x for x, b in zip(leaves, batched) if b]
        used = [i for i, g in enumerate(grad_out) if g is not None]
        grads = [grad_out[i] for i in used]

        def one_sample(sample, cotangents):
            it = iter(sample)
            full = [next(it).unsqueeze(bd) if b else c for b, c in zip(batched, const)]
            args, kwargs = tree_unflatten(full, spec)

            def forward(p):
                out = functional_call(module, p, args, kwargs)
                outs = out if isinstance(out, tuple) else (out,)
                return tuple(outs[i] for i in used)

            _, pullback = vjp(forward, params)
            return pullback(tuple(c.unsqueeze(bd) for c in cotangents))[0]

        with STATE.suspend(), torch.enable_grad():
            return vmap(one_sample, in_dims=(bd, bd))(sample_leaves, grads)


GENERIC = GenericRule()


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
