"""Random ops other than dropout replayed in a sample-by-sample re-run (``layers.random_replay``),
float64.

Stochastic depth draws its keep mask with ``x.new_empty(shape).bernoulli_(keep)`` (timm's
``DropPath``) or ``torch.empty(size).bernoulli_(survival)`` (torchvision's ``StochasticDepth``,
written here as torchvision writes it: torchvision does not import with this torch). A block
owning a raw parameter (a layer scale) has no rule of its own and is re-run sample by sample
(``layers.generic``); in training mode the re-run must see the forward's draws: one per sample
(``mode="row"``) or one for the whole batch (``mode="batch"``, shared by the samples). Per-sample
gradients are checked against an eager backward of each sample's loss with the forward's random
numbers replayed (``reference.per_sample_grads_replayed``); the engine's ``sum_n g_n == p.grad``
check runs in every pass. Ops that cannot be replayed raise, naming the op.
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
from fixtures.timm_like import DropPath
from reference import per_sample_grads_replayed

DT = torch.float64
N, T, D = 5, 3, 4


class StochasticDepth(nn.Module):
    """torchvision's ``StochasticDepth``: ``mode="row"`` one draw per sample, ``"batch"`` one
    for the whole batch."""

    def __init__(self, p: float, mode: str):
        super().__init__()
        self.p, self.mode = p, mode

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        survival_rate = 1.0 - self.p
        size = [x.shape[0]] + [1] * (x.ndim - 1) if self.mode == "row" else [1] * x.ndim
        noise = torch.empty(size, dtype=x.dtype, device=x.device)
        noise = noise.bernoulli_(survival_rate)
        noise.div_(survival_rate)
        return x * noise


class NoisyGate(nn.Module):
    """Other elementwise draws: a ``rand_like`` gate and ``randn_like`` noise on the hidden
    state, a ``torch.bernoulli`` of probabilities, a ``torch.rand`` of the batch's shape."""

    def forward(self, x):
        if not self.training:
            return x
        gate = (torch.rand_like(x) > 0.3).to(x.dtype)
        noise = 0.1 * torch.randn_like(x)
        coins = torch.bernoulli(torch.full_like(x, 0.8))
        scale = torch.rand(x.shape[0], 1, 1, dtype=x.dtype)
        return x * gate * coins * (1 + scale) + noise


class Block(nn.Module):
    """A residual block owning a raw layer scale ``gamma``: no rule, re-run sample by sample."""

    def __init__(self, path: nn.Module):
        super().__init__()
        self.fc = nn.Linear(D, D, dtype=DT)
        self.gamma = nn.Parameter(torch.full((D,), 0.7, dtype=DT))
        self.path = path

    def forward(self, x):
        return x + self.path(self.gamma * torch.tanh(self.fc(x)))


def _model(path: nn.Module):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(D, D, dtype=DT),
        Block(path),
        Block(copy.deepcopy(path)),
        nn.Flatten(),
        nn.Linear(T * D, 3, dtype=DT),
    ).train()


PATHS = {
    "timm": lambda: DropPath(0.4),
    "row": lambda: StochasticDepth(0.4, "row"),
    "batch": lambda: StochasticDepth(0.4, "batch"),
    "noise": NoisyGate,
}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("kind", list(PATHS))
def test_per_sample_gradients_with_the_forwards_draws(kind, reduction):
    plain = _model(PATHS[kind]())
    x, y = torch.randn(N, T, D, dtype=DT), torch.arange(N) % 3
    model = curvopt.extend(copy.deepcopy(plain))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss(reduction=reduction))
    state = torch.get_rng_state()
    loss = lossfunc(model(x), y)
    with curvopt.collect(ext.BatchGrad(), ext.SumGradSquared()):
        loss.backward()
    scale = 1 / N if reduction == "mean" else 1.0
    expected = per_sample_grads_replayed(
        plain, lambda net: F.cross_entropy(net(x), y, reduction="none") * scale, state
    )
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad_batch, expected[name], rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(p.sum_grad_squared, expected[name].square().sum(0))
        torch.testing.assert_close(p.grad, expected[name].sum(0), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("kind", ["timm", "row", "batch"])
def test_the_draws_matter(kind):
    """The check above is not vacuous: the forward draws, rows differ (one keep per sample,
    ``"row"``) and a forward from another generator state gives other gradients."""
    plain = _model(PATHS[kind]())
    x = torch.randn(N, T, D, dtype=DT)
    state = torch.get_rng_state()
    torch.manual_seed(3)
    kept = [plain[1].path(torch.ones(N, T, D, dtype=DT))[:, 0, 0] for _ in range(8)]
    dropped = torch.stack(kept) == 0
    assert dropped.any() and not dropped.all()
    if kind != "batch":
        assert (dropped.any(1) & ~dropped.all(1)).any()  # samples of one draw differ
    else:
        assert (dropped.all(1) | ~dropped.any(1)).all()  # one draw for the whole batch
    torch.set_rng_state(state)
    out = plain(x)
    assert not torch.equal(out, plain(x))


def test_eval_mode_draws_nothing():
    plain = _model(DropPath(0.4)).eval()
    x, y = torch.randn(N, T, D, dtype=DT), torch.arange(N) % 3
    model = curvopt.extend(copy.deepcopy(plain))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    with curvopt.collect(ext.BatchGrad()):
        lossfunc(model(x), y).backward()
    expected = per_sample_grads_replayed(
        plain, lambda net: F.cross_entropy(net(x), y, reduction="none") / N, torch.get_rng_state()
    )
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad_batch, expected[name], rtol=1e-9, atol=1e-12)


class Shuffle(nn.Module):
    """Mixes the positions with a random permutation: not replayed."""

    def forward(self, x):
        return x[:, torch.randperm(x.shape[1])] if self.training else x


class OwnGenerator(nn.Module):
    """Draws from a generator of its own, which the recorded state does not replay."""

    def __init__(self):
        super().__init__()
        self.generator = torch.Generator().manual_seed(0)

    def forward(self, x):
        return x * torch.rand(x.shape, generator=self.generator, dtype=x.dtype)


class FlatDraw(nn.Module):
    """A draw of the batch's element count, flat: its shape does not split into samples."""

    def forward(self, x):
        return x * torch.rand(x.numel() + 1, dtype=x.dtype)[: x.numel()].view_as(x)


@pytest.mark.parametrize(
    "path, op",
    [
        (Shuffle, "torch.randperm"),
        (OwnGenerator, r"torch.rand draws from a generator of its own"),
        (FlatDraw, r"shape \(61,\) for the batch and \(13,\) for one sample with torch.rand"),
    ],
)
def test_a_random_op_that_is_not_replayed_raises_naming_it(path, op):
    model = curvopt.extend(_model(path()))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    loss = lossfunc(model(torch.randn(N, T, D, dtype=DT)), torch.arange(N) % 3)
    with pytest.raises(UnsupportedModuleError, match=rf"'2' \(Block\).*{op}"):
        with curvopt.collect(ext.BatchGrad()):
            loss.backward()
