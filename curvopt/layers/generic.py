"""Fallback for any module that owns parameters: ``torch.func`` over single samples.

For sample ``n`` the module is re-run functionally on ``x_n`` (a batch of one) and the
vector-Jacobian product with ``dL/dy_n`` gives ``g_n``; ``vmap`` batches this over samples.
Costs one extra forward per sample; registered rules are faster.

Inputs are split into samples along ``batch_dim`` for every tensor argument whose size there
equals ``N``; others (masks, shared tensors) are passed whole. Stochastic modules in training
mode (dropout) cannot be re-run identically, so they are rejected.
"""

from __future__ import annotations

import inspect
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.func import functional_call, vjp, vmap
from torch.utils._pytree import tree_flatten, tree_unflatten

from curvopt.errors import UnsupportedModuleError
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

    def sample_inputs(self, call) -> Tuple[tuple, dict, List[Optional[int]]]:
        """``(args, kwargs, dims)``: the inputs to re-run the module on and, for each leaf of
        ``tree_flatten((args, kwargs))``, the dim that indexes samples (``None``: the leaf is
        shared by all samples). Default: tensors whose size along ``batch_dim`` is ``N``."""
        bd, n = call.batch_dim, call.batch_size
        leaves, _ = tree_flatten((call.args, call.kwargs))
        dims = [
            bd if isinstance(x, torch.Tensor) and x.dim() > bd and x.shape[bd] == n else None
            for x in leaves
        ]
        return call.args, call.kwargs, dims

    def output_dims(self, call, count: int) -> List[int]:
        """The dim indexing samples in each of the module's ``count`` tensor outputs."""
        return [call.batch_dim] * count

    def rerun(self, module, params, args, kwargs):
        """The module's output on one sample (inputs as :meth:`sample_inputs` made them)."""
        return functional_call(module, params, args, kwargs)

    def batch_grads(self, call) -> Dict[str, torch.Tensor]:
        """All owned parameters' per-sample gradients from one vmapped pass."""
        module = call.module
        params = {
            k: p.detach()
            for k, p in owned_parameters(module, self.owns_children).items()
            if p.requires_grad
        }
        grad_out = call.grad_out if isinstance(call.grad_out, tuple) else (call.grad_out,)
        args, kwargs, dims = self.sample_inputs(call)
        leaves, spec = tree_flatten((args, kwargs))
        leaves = [x.detach() if isinstance(x, torch.Tensor) else x for x in leaves]
        const = [None if d is not None else x for x, d in zip(leaves, dims)]
        sample_leaves = [x for x, d in zip(leaves, dims) if d is not None]
        sample_dims = [d for d in dims if d is not None]
        out_dims = self.output_dims(call, len(grad_out))
        used = [i for i, g in enumerate(grad_out) if g is not None]
        grads = [grad_out[i] for i in used]
        grad_dims = [out_dims[i] for i in used]

        def one_sample(sample, cotangents):
            it = iter(zip(sample, sample_dims))
            full = [c if d is None else _unsqueeze(*next(it)) for d, c in zip(dims, const)]
            args, kwargs = tree_unflatten(full, spec)

            def forward(p):
                out = self.rerun(module, p, args, kwargs)
                outs = out if isinstance(out, tuple) else (out,)
                return tuple(outs[i] for i in used)

            _, pullback = vjp(forward, params)
            return pullback(tuple(c.unsqueeze(d) for c, d in zip(cotangents, grad_dims)))[0]

        with STATE.suspend(), torch.enable_grad():
            try:
                return vmap(one_sample, in_dims=(sample_dims, grad_dims))(sample_leaves, grads)
            except (RuntimeError, NotImplementedError, ValueError) as error:
                path = getattr(module, "_curvopt_path", type(module).__name__)
                raise UnsupportedModuleError(
                    f"curvopt cannot compute per-sample quantities for module {path!r} "
                    f"({type(module).__name__}): it has no dedicated rule and re-running it sample "
                    f"by sample with torch.func.vmap failed ({type(error).__name__}: {error}); "
                    "register a rule for it with curvopt.layers.register"
                ) from error


def _unsqueeze(x, dim):
    return x.unsqueeze(dim)


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
