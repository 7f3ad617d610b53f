"""The first-order reducer's totals ``sum_n g_n``: the moments of ``Variance`` and the sums the
checks compare with ``p.grad``, whichever of a rule's fast paths exist."""

import pytest
import torch
from conftest import DT, per_sample_grads_loop
from torch import nn

import curvopt
from curvopt import extensions as ext
from curvopt.layers import LayerRule, register


class SquaresOnly(nn.Module):
    """``x [N, I] -> x Wᵀ`` by ``einsum``; its rule has ``sum_grad_squared`` but no
    ``grad_sum`` and no ``batch_l2``."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 5, dtype=DT))

    def forward(self, x):
        return torch.einsum("ni,oi->no", x, self.weight)


@register(SquaresOnly)
class SquaresOnlyRule(LayerRule):
    def batch_grad(self, call, name, out=None):
        return torch.einsum("no,ni->noi", call.grad_out, call.input)

    def sum_grad_squared(self, call, name):
        return call.grad_out.square().T @ call.input.square()


@pytest.mark.parametrize("attrs", [("variance",), ("sum_grad_squared", "batch_l2", "variance")])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_fast_squares_without_a_grad_sum(attrs, reduction, seed):
    """The mean of the moments comes from the per-sample gradients when the rule has no
    ``grad_sum``; with ``batch_l2`` also wanted, from the chunks it needs anyway."""
    torch.manual_seed(0)
    plain = nn.Sequential(SquaresOnly(), nn.Tanh(), nn.Linear(3, 2)).to(DT)
    x, y = torch.randn(6, 5, dtype=DT), torch.randn(6, 2, dtype=DT)
    lossfunc = nn.MSELoss(reduction=reduction)
    reference = per_sample_grads_loop(plain, lossfunc, x, y)["0.weight"]
    model = curvopt.extend(plain)
    loss = curvopt.extend(lossfunc)(model(x), y)
    with curvopt.collect(*(ext.extension(a) for a in attrs)):
        loss.backward()
    w = model[0].weight
    expected = {
        "variance": reference.square().mean(0) - reference.mean(0).square(),
        "sum_grad_squared": reference.square().sum(0),
        "batch_l2": reference.square().sum((1, 2)),
    }
    for attr in attrs:
        torch.testing.assert_close(getattr(w, attr), expected[attr], rtol=1e-10, atol=1e-12)
