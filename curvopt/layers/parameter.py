"""A raw parameter read where it meets the batch: ``g_n = dL_n/dp`` from the gradient at its use.

A module's own parameter used in its forward only through an add or an expand over the batch
(a ViT's ``cls_token.expand(N, -1, -1)``, ``h + pos_embed``) has its per-sample gradients at
that op's output ``u [N, *b]``, reduced over the dims it was broadcast along
(``graph.broadcast``): ``g_n = reduce(dL/du_n)``, since ``u_n`` reaches sample ``n``'s loss
alone. The engine reads them there instead of re-running the module sample by sample
(``generic``), in two ways:

* first order (``engine.parameter_sites.SiteReadings``): the reading is handed to
  :data:`PARAMETER` as the call's output gradient, ``Call.grad_out = [N, *p.shape]``;
* curvature (``engine.parameter_sites``): the parameter is a call of its own,
  :class:`RawParameter`, whose "output" is ``p`` at its site: the columns ``V = Jᵀ S``
  propagated there, by sample, ``[K, N, *p.shape]``, are its per-(column, sample) gradients
  ``J_nᵀ v_nk``, so ``diag_n = sum_k v_nk²`` (GGN, exact or Monte-Carlo, as the columns are).
  A one-dimensional parameter gets its exact block ``[B] = sum_{k,n} v_nk v_nkᵀ``; any other has
  no Kronecker factorisation (``KFAC``'s ``fallback="diagonal"`` steps it by the diagonal).
"""

from __future__ import annotations

import torch
from torch import nn

from curvopt.core.reductions import squared_norms, sum_of_squares
from curvopt.errors import kronecker_error
from curvopt.layers.registry import LayerRule, register


class RawParameter(nn.Module):
    """The raw parameter ``name`` of ``owner`` as a module of its own (never called): what the
    engine computes through for a parameter read at its site. ``owner`` is kept unregistered
    (errors name it; its parameters are not this module's)."""

    def __init__(self, owner: nn.Module, name: str, p: nn.Parameter):
        super().__init__()
        self.register_parameter(name, p)
        object.__setattr__(self, "owner", owner)

    def forward(self, *args, **kwargs):
        raise RuntimeError("RawParameter stands for a parameter read at its site; never called")


def _by_sample(call, columns, name: str) -> torch.Tensor:
    """``[K, N, *b] -> [N, K, *p.shape]``: the columns at the site as gradients of ``p``."""
    shape = getattr(call.module, name).shape
    return columns.reshape(columns.shape[0], columns.shape[1], *shape).transpose(0, 1)


@register(RawParameter)
class ParameterRule(LayerRule):
    def batch_grad(self, call, name, out=None):
        return call.grad_out if out is None else out.copy_(call.grad_out)

    def batch_l2(self, call, name):
        return squared_norms(call.grad_out)

    def sum_grad_squared(self, call, name):
        return sum_of_squares(call.grad_out)

    def grad_sum(self, call, name):
        return call.grad_out.sum(0)

    def column_grads(self, call, columns, name):
        return _by_sample(call, columns, name)

    def expanded_batch_grad(self, call, columns, name):
        return _by_sample(call, columns, name).transpose(0, 1).flatten(0, 1)

    def column_diag(self, call, columns, name, batched):
        grads = _by_sample(call, columns, name)
        return grads.square().sum(1) if batched else sum_of_squares(grads, dims=2)

    def kron_output_factor(self, call, columns, name, approx, n):
        p = getattr(call.module, name)
        if self.vector_parameter(name, p):
            return None  # the exact block, from the columns (``kron.kron_factors``)
        raise kronecker_error(
            call.module.owner,
            f"parameter {name!r}",
            "curvopt factors only Linear, Conv, Embedding and Conv1D weights and 1-D parameters",
        )


PARAMETER = ParameterRule()
