"""Kronecker factors of a weight used by several calls: the nearest Kronecker product of the
sum of the per-use KFAC blocks, checked against a dense reference.

The per-use factors come from an untied copy of the model (each use its own parameter with the
same values); the reference rearranges the dense sum of their Kronecker products and takes its
best rank-one term by an SVD (Van Loan & Pitsianis).
"""

import copy

import pytest
import torch
from conftest import DT, nearest_kronecker_dense
from torch import nn

import curvopt
from curvopt import extensions as ext


class _TiedHead(nn.Module):
    """Embedding and output layer sharing one weight (GPT-style), or two equal weights."""

    def __init__(self, tied=True):
        super().__init__()
        self.emb, self.mix, self.head = nn.Embedding(6, 4), nn.Linear(4, 4), nn.Linear(4, 6)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(torch.tanh(self.mix(self.emb(idx))))


class _Twice(nn.Module):
    def __init__(self, shared=True):
        super().__init__()
        self.first, self.second = nn.Linear(3, 3), nn.Linear(3, 3)
        if shared:
            self.second = self.first

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)))


def _kflr(model, lossfunc, x, y, approx):
    model = curvopt.extend(model)
    with curvopt.collect(ext.KFLR(kfac_approx=approx)):
        lossfunc(model(x), y).backward()
    return model


@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_tied_embedding_and_head(approx):
    torch.manual_seed(0)
    tied = _TiedHead().to(DT)
    untied = _TiedHead(tied=False).to(DT)
    untied.load_state_dict({**tied.state_dict(), "head.weight": tied.emb.weight.detach()})
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    idx = torch.randint(0, 6, (3, 5))
    y = torch.randint(0, 6, (3, 5))

    def loss(out, target):
        return lossfunc(out.reshape(-1, 6), target.reshape(-1))

    got = _kflr(copy.deepcopy(tied), lambda o, t: loss(o, t), idx, y, approx)
    parts = _kflr(untied, lambda o, t: loss(o, t), idx, y, approx)
    dense = torch.kron(*parts.emb.weight.kflr) + torch.kron(*parts.head.weight.kflr)
    want = nearest_kronecker_dense(dense, 6, 4)
    factors = got.emb.weight.kflr
    torch.testing.assert_close(torch.kron(*factors), want, rtol=1e-8, atol=1e-12)
    for f in factors:  # symmetric positive semi-definite
        torch.testing.assert_close(f, f.T)
        assert torch.linalg.eigvalsh(f).min() > -1e-10 * torch.linalg.eigvalsh(f).max()
    # the layers using one weight each are unchanged
    torch.testing.assert_close(got.mix.weight.kflr[0], parts.mix.weight.kflr[0])


def test_module_used_twice():
    torch.manual_seed(0)
    shared = _Twice().to(DT)
    separate = _Twice(shared=False).to(DT)
    separate.second.load_state_dict(shared.first.state_dict())
    separate.first.load_state_dict(shared.first.state_dict())
    lossfunc = curvopt.extend(nn.MSELoss())
    x, y = torch.randn(4, 3, dtype=DT), torch.randn(4, 3, dtype=DT)
    got = _kflr(copy.deepcopy(shared), lossfunc, x, y, "expand")
    parts = _kflr(separate, lossfunc, x, y, "expand")
    dense = torch.kron(*parts.first.weight.kflr) + torch.kron(*parts.second.weight.kflr)
    torch.testing.assert_close(
        torch.kron(*got.first.weight.kflr), nearest_kronecker_dense(dense, 3, 3)
    )
    bias = parts.first.bias.kflr[0] + parts.second.bias.kflr[0]  # 1-D: the blocks add exactly
    torch.testing.assert_close(got.first.bias.kflr[0], bias)
