"""Dropout in training mode never blocks a quantity (``layers.random_replay``), in float64.

A module without a rule of its own is re-run sample by sample (``layers.generic``); in training
mode it is re-run with the masks its forward drew: ``nn.Dropout``/``nn.Dropout2d``, a
functional ``F.dropout``, ``F.scaled_dot_product_attention(dropout_p=...)`` and an
``nn.MultiheadAttention`` with attention dropout inside it (both of its paths:
``need_weights`` or not, sequence first or not). Per-sample gradients are checked against an
eager backward of each sample's loss with the forward's random numbers replayed
(``reference.per_sample_grads_replayed``).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import curvopt
from curvopt import extensions as ext
from curvopt.errors import UnsupportedModuleError
from reference import per_sample_grads_replayed

DT = torch.float64
N, T, D = 4, 5, 6


class RawBlock(nn.Module):
    """Owns raw parameters (a class token, positions, a scale): re-run sample by sample."""

    def __init__(self, need_weights=False, batch_first=True):
        super().__init__()
        self.cls = nn.Parameter(0.1 * torch.randn(1, 1, D, dtype=DT))
        self.pos = nn.Parameter(0.1 * torch.randn(1, T + 1, D, dtype=DT))
        self.scale = nn.Parameter(torch.ones(D, dtype=DT))
        self.drop = nn.Dropout(0.3)
        self.drop2d = nn.Dropout2d(0.3)
        self.attn = nn.MultiheadAttention(D, 2, dropout=0.4, batch_first=batch_first, dtype=DT)
        self.need_weights, self.batch_first = need_weights, batch_first

    def forward(self, x):
        h = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
        h = self.drop(h) * self.scale
        h = self.drop2d(h.unsqueeze(-1)).squeeze(-1)  # channels: the T + 1 positions
        h = F.dropout(h, 0.2, self.training)
        q = h.unflatten(-1, (2, D // 2)).transpose(1, 2)
        h = h + F.scaled_dot_product_attention(q, q, q, dropout_p=0.25).transpose(1, 2).flatten(2)
        if not self.batch_first:
            h = h.transpose(0, 1)
        out, weights = self.attn(h, h, h, need_weights=self.need_weights)
        if not self.batch_first:
            out = out.transpose(0, 1)
        pooled = out[:, 0]
        if self.need_weights:
            pooled = pooled + weights[:, 0, :D]
        return pooled


def _model(**kwargs):
    torch.manual_seed(0)
    return nn.Sequential(RawBlock(**kwargs), nn.Tanh(), nn.Linear(D, 3, dtype=DT)).train()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize(
    "kwargs", [{}, {"need_weights": True}, {"batch_first": False}], ids=["sdpa", "weights", "seq"]
)
def test_per_sample_gradients_with_the_forwards_masks(kwargs, reduction):
    plain = _model(**kwargs)
    x, y = torch.randn(N, T, D, dtype=DT), torch.arange(N) % 3
    model = curvopt.extend(copy.deepcopy(plain))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss(reduction=reduction))
    state = torch.get_rng_state()
    loss = lossfunc(model(x), y)
    with curvopt.collect(ext.BatchGrad(), ext.DiagGGNMC()):
        loss.backward()
    scale = 1 / N if reduction == "mean" else 1.0
    expected = per_sample_grads_replayed(
        plain, lambda net: F.cross_entropy(net(x), y, reduction="none") * scale, state
    )
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad_batch, expected[name], rtol=1e-9, atol=1e-12)
        assert p.diag_ggn_mc.shape == p.shape


def test_the_masks_differ_between_samples_and_forwards():
    """The check above is not vacuous: two forwards draw different masks, and the per-sample
    gradients of a re-drawn forward are not those of the recorded one."""
    plain = _model()
    x = torch.randn(N, T, D, dtype=DT)
    first = torch.get_rng_state()
    out = plain(x)
    assert not torch.equal(out, plain(x))
    torch.set_rng_state(first)
    assert torch.equal(out, plain(x))


def test_alpha_dropout_is_refused_with_its_reason():
    block = RawBlock()
    block.drop = nn.AlphaDropout(0.2)
    model = curvopt.extend(nn.Sequential(block, nn.Linear(D, 3, dtype=DT)).train())
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    loss = lossfunc(model(torch.randn(N, T, D, dtype=DT)), torch.arange(N) % 3)
    with pytest.raises(UnsupportedModuleError, match=r"'0' .*alpha dropout"):
        with curvopt.collect(ext.BatchGrad()):
            loss.backward()
