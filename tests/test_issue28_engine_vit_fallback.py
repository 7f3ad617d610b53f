"""``optim.KFAC(fallback="diagonal")`` on a plain-torch ViT block with raw ``cls``/``pos``
parameters, float64: the generic rule re-runs the model under ``vmap`` for those parameters'
per-sample gradients, and the factored step's capture (``optim.gradient_factors``) must keep
only the model's own calls, never the batched tensors of curvopt's re-runs (which crashed
``torch.cat`` inside functorch). Steps against the same optimizer without the captured
factors (the dense product), and the captured factors against the layers' gradients."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import curvopt
from curvopt.optim import KFAC
from curvopt.optim.gradient_factors import reproduces

DT = torch.float64


class ViTBlock(nn.Module):
    """``Conv2d(3, d, 8, 8)`` patches, raw ``cls [1, 1, d]`` and ``pos [1, 5, d]``, pre-norm
    attention (``qkv`` Linear, ``reshape/permute/unbind``, softmax), GELU MLP, head on token 0."""

    def __init__(self, d=16, heads=2, classes=3):
        super().__init__()
        self.patch = nn.Conv2d(3, d, 8, 8)
        self.cls = nn.Parameter(0.1 * torch.randn(1, 1, d))
        self.pos = nn.Parameter(0.1 * torch.randn(1, 5, d))
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.head = nn.Linear(d, classes)
        self.heads = heads

    def forward(self, images):
        t = self.patch(images).flatten(2).transpose(1, 2)
        t = torch.cat([self.cls.expand(t.shape[0], -1, -1), t], 1) + self.pos
        n, length, d = t.shape
        qkv = self.qkv(self.norm1(t)).reshape(n, length, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        attention = (q @ k.transpose(-2, -1) / (d // self.heads) ** 0.5).softmax(-1)
        t = t + self.proj((attention @ v).transpose(1, 2).reshape(n, length, d))
        t = t + self.fc2(F.gelu(self.fc1(self.norm2(t))))
        return self.head(t[:, 0])


def _batches():
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(4, 3, 16, 16, generator=g, dtype=DT), torch.randint(0, 3, (4,), generator=g))
        for _ in range(3)
    ]


def _train(without_captured_factors=False):
    torch.manual_seed(0)
    model = curvopt.extend(ViTBlock().to(DT))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    opt = KFAC(model.parameters(), lr=0.05, damping=1e-3, fallback="diagonal")
    if without_captured_factors:
        opt._gradient_factors = lambda param: None
    reproduced = []
    for x, y in _batches():
        opt.zero_grad()
        with opt.collect():
            lossfunc(model(x), y).backward()
        factors = opt._gradient_factors(model.qkv.weight)
        reproduced.append(factors is not None and reproduces(model.qkv.weight.grad, factors))
        opt.step()
    return [p.detach().clone() for p in model.parameters()], reproduced


def test_kfac_with_diagonal_fallback_trains_a_vit_with_raw_parameters():
    params, reproduced = _train()
    reference, _ = _train(without_captured_factors=True)
    assert reproduced == [True, True, True]  # the captured (a, b) give the layer's gradient
    for p, q in zip(params, reference):
        assert torch.isfinite(p).all()
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)
    torch.manual_seed(0)
    initial = ViTBlock().to(DT)
    assert not torch.equal(params[0], initial.cls) and not torch.equal(params[1], initial.pos)
