"""The overhead benchmark's networks with random data: a registry of ``Problem``s.

Every problem builds, from a fixed seed, a float32 model, a batch ``(X, y)`` and a loss module
(``CrossEntropyLoss``, ``reduction="mean"``). Models are plain ``nn.Module``s with no parameters
outside registered layer types, so curvopt, torch.func, Opacus and BackPACK can all be applied to
independent copies of the same network (``Problem.build`` returns fresh copies every call).

* ``3c3d``        DeepOBS 3C3D on CIFAR-10 shapes (3x32x32, 10 classes), N=64
* ``mlp``         784-512-256-10 with ReLU, N=64
* ``cnn``         small CNN: 2 x (conv 3x3 same, ReLU, maxpool 2) + linear, 3x32x32, N=64
* ``transformer`` one pre-LN transformer block (token + position embeddings, batch-first
                  MultiheadAttention, LayerNorm, MLP, residuals), mean-pooled to 10 classes;
                  N=16, T=32, d=64, vocabulary 1000
* ``logreg``, ``2c2d``  DeepOBS MNIST logistic regression and Fashion-MNIST 2C2D, N=64
* ``gpt``         GPT-style decoder of ``fixtures/zoo.py`` (causal block, tied output layer),
                  next-token loss over the flattened ``[N·T, V]`` logits; N=16, T=32, d=64,
                  vocabulary 256
* ``deep_narrow`` 32 x (``Linear(16, 16)``, ReLU) + ``Linear(16, 10)``, N=8: every operator
                  is a few µs, so a step costs what is spent per module (the launch-bound
                  regime of a GPU; ``benchmarks.per_module_cost``)

``problem.resized(n)`` is the same problem with batch size ``n`` (the first ``n`` samples of
the same random stream are not guaranteed; the data is redrawn from the same seed).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch import nn

from fixtures import zoo

from ..problems import (
    cifar10_3c3d,
    cifar100_allcnnc,
    fmnist_2c2d,
    mnist_logreg,
)


def c3d3() -> nn.Sequential:
    """DeepOBS ``cifar10_3c3d``: 3 conv + 3 dense layers (895,210 parameters)."""
    return cifar10_3c3d()


def c3d3_sigmoid() -> nn.Sequential:
    """3C3D with its first ReLU replaced by a Sigmoid (the paper's DiagHessian benchmark)."""
    model = cifar10_3c3d()
    first = next(i for i, m in enumerate(model) if isinstance(m, nn.ReLU))
    model[first] = nn.Sigmoid()
    return model


def mlp() -> nn.Sequential:
    """784-512-256-10 with ReLU (535,818 parameters)."""
    return nn.Sequential(
        nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10)
    )


def deep_narrow(depth: int = 32, width: int = 16, classes: int = 10) -> nn.Sequential:
    """``depth`` x (``Linear(width, width)``, ReLU) and a ``Linear(width, classes)`` head
    (``depth + 1`` Linear modules; 8,874 parameters at the defaults)."""
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, classes))


def small_cnn(num_classes: int = 10) -> nn.Sequential:
    """2 x (conv 3x3 same, ReLU, maxpool 2) + linear on 3x32x32 (25,578 parameters)."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),  # 32 -> 16
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),  # 16 -> 8
        nn.Flatten(),
        nn.Linear(32 * 8 * 8, num_classes),
    )


class TransformerBlock(nn.Module):
    """Token + position embeddings, one pre-LN block, final LayerNorm, mean pool, linear head.

    Positions enter as an ``nn.Embedding`` of ``arange(T)`` expanded over the batch (instead of
    a bare ``nn.Parameter``), so every parameter belongs to a standard layer.
    """

    def __init__(self, vocab=1000, seq_len=32, d_model=64, heads=4, d_ff=256, num_classes=10):
        super().__init__()
        self.seq_len = seq_len
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d_model)
        self.ff1 = nn.Linear(d_model, d_ff)
        self.act = nn.GELU()
        self.ff2 = nn.Linear(d_ff, d_model)
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        n, t = idx.shape
        positions = torch.arange(t, device=idx.device).expand(n, t)
        h = self.tok(idx) + self.pos(positions)
        a = self.ln1(h)
        h = h + self.attn(a, a, a, need_weights=False)[0]
        h = h + self.ff2(self.act(self.ff1(self.ln2(h))))
        return self.head(self.ln_f(h).mean(1))


class TokenLogits(nn.Module):
    """A language model's logits ``[N, T, V]`` flattened to the loss rows ``[N·T, V]``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        logits = self.model(idx)
        return logits.reshape(-1, logits.shape[-1])


def gpt(vocab: int = 256, d: int = 64, heads: int = 4, seq_len: int = 32) -> nn.Module:
    """``fixtures.zoo.GPT`` at benchmark size, logits flattened for ``CrossEntropyLoss``."""
    return TokenLogits(zoo.GPT(vocab=vocab, d=d, heads=heads, t_max=seq_len))


@dataclass(frozen=True)
class Problem:
    """A network, a random batch of ``batch_size`` samples and a loss; ``build()`` returns
    fresh, identical copies."""

    name: str
    what: str
    make_model: Callable[[], nn.Module]
    make_data: Callable[[torch.Generator, int], tuple[torch.Tensor, torch.Tensor]]
    batch_size: int
    seed: int = 0

    @property
    def description(self) -> str:
        return f"{self.what}, N={self.batch_size}"

    def resized(self, batch_size: int) -> Problem:
        """The same network and loss with a batch of ``batch_size`` samples."""
        return replace(self, batch_size=batch_size)

    def build(self) -> tuple[nn.Module, torch.Tensor, torch.Tensor, nn.Module]:
        """``(model, X, y, lossfunc)``, float32, identical on every call (fixed seed)."""
        torch.manual_seed(self.seed)
        model = self.make_model().float()
        X, y = self.make_data(torch.Generator().manual_seed(self.seed + 1), self.batch_size)
        return model, X, y, nn.CrossEntropyLoss()


def _images(shape, classes):
    def make(gen, n):
        return torch.randn(n, *shape, generator=gen), torch.randint(classes, (n,), generator=gen)

    return make


def _tokens(seq_len, vocab, classes):
    def make(gen, n):
        X = torch.randint(vocab, (n, seq_len), generator=gen)
        return X, torch.randint(classes, (n,), generator=gen)

    return make


def _next_tokens(seq_len, vocab):
    """Token inputs ``[N, T]`` and their next tokens, flattened: targets ``[N·T]``."""

    def make(gen, n):
        tokens = torch.randint(vocab, (n, seq_len + 1), generator=gen)
        return tokens[:, :-1], tokens[:, 1:].reshape(-1)

    return make


PROBLEMS: dict[str, Problem] = {
    p.name: p
    for p in (
        Problem("3c3d", "DeepOBS 3C3D, CIFAR-10 shapes", c3d3, _images((3, 32, 32), 10), 64),
        Problem(
            "3c3d_sigmoid",
            "3C3D, first ReLU -> Sigmoid",
            c3d3_sigmoid,
            _images((3, 32, 32), 10),
            8,
        ),
        Problem(
            "allcnnc",
            "DeepOBS All-CNN-C, CIFAR-100 shapes",
            cifar100_allcnnc,
            _images((3, 32, 32), 100),
            16,
        ),
        Problem("mlp", "MLP 784-512-256-10", mlp, _images((784,), 10), 64),
        Problem(
            "cnn",
            "small CNN (2 conv + linear), 3x32x32",
            small_cnn,
            _images((3, 32, 32), 10),
            64,
        ),
        Problem(
            "transformer",
            "transformer block, T=32 d=64",
            TransformerBlock,
            _tokens(32, 1000, 10),
            16,
        ),
        Problem("logreg", "DeepOBS MNIST logreg", mnist_logreg, _images((1, 28, 28), 10), 64),
        Problem("2c2d", "DeepOBS Fashion-MNIST 2C2D", fmnist_2c2d, _images((1, 28, 28), 10), 64),
        Problem("gpt", "GPT-style decoder, T=32 d=64 V=256", gpt, _next_tokens(32, 256), 16),
        Problem(
            "deep_narrow",
            "32 x (Linear(16, 16), ReLU) + Linear(16, 10)",
            deep_narrow,
            _images((16,), 10),
            8,
        ),
    )
}
