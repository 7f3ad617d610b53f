"""A raw parameter read where it meets the batch: ``g_n = dL_n/dp`` given as the call's output
gradient (``Call.grad_out``, ``[N, *p.shape]``).

A module's own parameter used in its forward only through an add or an expand over the batch
(a ViT's ``cls.expand(N, -1, -1)``, ``h + pos``) has its per-sample gradients at that op's
output, reduced over the dims it was broadcast along (``graph.broadcast``); the engine reads
them there and hands them to this rule instead of re-running the module sample by sample
(``generic``). Not registered for any module type: the engine picks it per parameter.
"""

from __future__ import annotations

from curvopt.layers.registry import LayerRule
from curvopt.core.reductions import squared_norms, sum_of_squares


class ParameterRule(LayerRule):
    def batch_grad(self, call, name, out=None):
        return call.grad_out if out is None else out.copy_(call.grad_out)

    def batch_l2(self, call, name):
        return squared_norms(call.grad_out)

    def sum_grad_squared(self, call, name):
        return sum_of_squares(call.grad_out)

    def grad_sum(self, call, name):
        return call.grad_out.sum(0)


PARAMETER = ParameterRule()
