"""The DeepOBS test problems of the BackPACK paper, as plain ``nn.Sequential`` models, and a
small vision transformer on Fashion-MNIST (``fmnist_vit``, the time-to-result benchmark's
transformer).

TensorFlow's 'same' padding can be asymmetric (one more row/column at the bottom/right); it is
written as an explicit ``nn.ZeroPad2d`` in front of the layer. Zero padding in front of a max-pool
equals TensorFlow's (ignore the border) because every pool here follows a ReLU.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .problem import EncoderBlock, Problem
from .workloads import WORKLOADS


def tf_same_padding(size: int, kernel: int, stride: int) -> tuple[int, int]:
    """Padding before/after of TensorFlow's 'same' for one spatial dimension."""
    out = math.ceil(size / stride)
    total = max((out - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


def conv_same(c_in: int, c_out: int, kernel: int, size: int, stride: int = 1) -> list[nn.Module]:
    """A 'same' convolution: symmetric padding inside the conv, else an explicit pad in front."""
    before, after = tf_same_padding(size, kernel, stride)
    if before == after:
        return [nn.Conv2d(c_in, c_out, kernel, stride, padding=before)]
    return [nn.ZeroPad2d((before, after, before, after)), nn.Conv2d(c_in, c_out, kernel, stride)]


def maxpool_same(kernel: int, stride: int, size: int) -> list[nn.Module]:
    """A 'same' max-pool (after a ReLU)."""
    before, after = tf_same_padding(size, kernel, stride)
    pad = [nn.ZeroPad2d((before, after, before, after))] if before or after else []
    return pad + [nn.MaxPool2d(kernel, stride)]


def _init(model: nn.Module, conv_w, linear_w, bias: float) -> nn.Module:
    for m in model.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            (conv_w if isinstance(m, nn.Conv2d) else linear_w)(m.weight)
            nn.init.constant_(m.bias, bias)
    return model


def _trunc_normal_005(w: torch.Tensor) -> None:
    """TensorFlow's ``truncated_normal(stddev=0.05)``: redraw beyond two standard deviations."""
    nn.init.trunc_normal_(w, mean=0.0, std=0.05, a=-0.1, b=0.1)


def mnist_logreg() -> nn.Sequential:
    """Logistic regression, weights and biases zero."""
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 10))
    return _init(model, None, nn.init.zeros_, 0.0)


def fmnist_2c2d() -> nn.Sequential:
    """Two conv (5x5, 32 and 64 filters) + max-pool blocks, fc 1024, fc 10.

    DeepOBS draws all weights from a normal with std 0.05 truncated at 2 std; biases are 0.05.
    """
    model = nn.Sequential(
        *conv_same(1, 32, 5, 28),
        nn.ReLU(),
        *maxpool_same(2, 2, 28),
        *conv_same(32, 64, 5, 14),
        nn.ReLU(),
        *maxpool_same(2, 2, 14),
        nn.Flatten(),
        nn.Linear(7 * 7 * 64, 1024),
        nn.ReLU(),
        nn.Linear(1024, 10),
    )
    return _init(model, _trunc_normal_005, _trunc_normal_005, 0.05)


def cifar10_3c3d() -> nn.Sequential:
    """Three conv + max-pool(3, stride 2, 'same') blocks, fc 512, fc 256, fc 10.

    Conv weights Xavier-normal, linear weights Xavier-uniform, biases zero (DeepOBS).
    """
    model = nn.Sequential(
        nn.Conv2d(3, 64, 5),
        nn.ReLU(),
        *maxpool_same(3, 2, 28),
        nn.Conv2d(64, 96, 3),
        nn.ReLU(),
        *maxpool_same(3, 2, 12),
        *conv_same(96, 128, 3, 6),
        nn.ReLU(),
        *maxpool_same(3, 2, 6),
        nn.Flatten(),
        nn.Linear(3 * 3 * 128, 512),
        nn.ReLU(),
        nn.Linear(512, 256),
        nn.ReLU(),
        nn.Linear(256, 10),
    )
    return _init(model, nn.init.xavier_normal_, nn.init.xavier_uniform_, 0.0)


def cifar100_allcnnc() -> nn.Sequential:
    """All-CNN-C (Springenberg et al., 2015) with DeepOBS's dropout, ReLU after every conv and a
    global spatial mean at the end. Xavier-normal weights, biases 0.1 (DeepOBS)."""
    model = nn.Sequential(
        nn.Dropout(0.2),
        *conv_same(3, 96, 3, 32),
        nn.ReLU(),
        *conv_same(96, 96, 3, 32),
        nn.ReLU(),
        *conv_same(96, 96, 3, 32, stride=2),
        nn.ReLU(),
        nn.Dropout(0.5),
        *conv_same(96, 192, 3, 16),
        nn.ReLU(),
        *conv_same(192, 192, 3, 16),
        nn.ReLU(),
        *conv_same(192, 192, 3, 16, stride=2),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.Conv2d(192, 192, 3),
        nn.ReLU(),
        nn.Conv2d(192, 192, 1),
        nn.ReLU(),
        nn.Conv2d(192, 100, 1),
        nn.ReLU(),
        nn.AvgPool2d(6),
        nn.Flatten(),
    )
    return _init(model, nn.init.xavier_normal_, None, 0.1)


class ViT(nn.Module):
    """Vision transformer ``images [N, C, H, W] -> logits [N, classes]``: non-overlapping
    ``patch x patch`` patches embedded by a strided ``Conv2d``, a raw class token and raw
    position embeddings (``nn.Parameter``, no Kronecker factors), ``depth`` pre-LayerNorm
    blocks, a final LayerNorm and a linear head on the class token."""

    def __init__(
        self,
        image: tuple[int, int, int] = (1, 28, 28),
        patch: int = 7,
        d: int = 64,
        depth: int = 2,
        heads: int = 4,
        mlp: int = 128,
        classes: int = 10,
    ):
        super().__init__()
        channels, height, width = image
        if height % patch or width % patch or d % heads:
            raise ValueError(
                f"ViT: the patch size {patch} must divide the image ({height}x{width}) and "
                f"the number of heads {heads} the width {d}"
            )
        tokens = (height // patch) * (width // patch)
        self.patch = nn.Conv2d(channels, d, patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        self.pos = nn.Parameter(0.02 * torch.randn(1, tokens + 1, d))
        self.blocks = nn.Sequential(*(EncoderBlock(d, heads, mlp) for _ in range(depth)))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        return self.head(self.norm(self.blocks(x))[:, 0])


def fmnist_vit() -> ViT:
    """A small ViT for Fashion-MNIST: 7x7 patches (16 tokens and the class token), width 64,
    2 blocks of 4 heads, MLP 128; PyTorch's default initialisation of the layers."""
    return ViT()


PROBLEMS: dict[str, Problem] = {
    p.name: p
    for p in (
        Problem("mnist_logreg", "mnist", mnist_logreg, batch_size=128, epochs=50),
        Problem("fmnist_2c2d", "fmnist", fmnist_2c2d, batch_size=128, epochs=100),
        Problem("fmnist_vit", "fmnist", fmnist_vit, batch_size=128, epochs=100),
        Problem(
            "cifar10_3c3d",
            "cifar10",
            cifar10_3c3d,
            batch_size=128,
            epochs=100,
            weight_decay=0.002,
            augment=True,
        ),
        Problem(
            "cifar100_allcnnc",
            "cifar100",
            cifar100_allcnnc,
            batch_size=256,
            epochs=350,
            weight_decay=5e-4,
            augment=True,
        ),
    )
}


def get_problem(name: str) -> Problem:
    """The problem ``name``: the DeepOBS problems and the ViT (:data:`PROBLEMS`), or the
    time-to-result benchmark's own workloads (:data:`experiments.workloads.WORKLOADS`)."""
    try:
        return PROBLEMS.get(name) or WORKLOADS[name]
    except KeyError:
        known = ", ".join([*PROBLEMS, *WORKLOADS])
        raise ValueError(f"unknown problem {name!r}; choose from {known}") from None
