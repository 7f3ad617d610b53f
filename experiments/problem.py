"""What a problem of the experiments is (:class:`Problem`: data set, architecture, loss and
training set-up) and the transformer blocks the problems share (the ViT of
``experiments.problems``, the character GPT of ``experiments.workloads``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .data import SPECS, Preprocess


class SelfAttention(nn.Module):
    """``proj(softmax(q kᵀ / √d_h) v)`` per head, ``q, k, v = split(qkv(x))``, ``x: [N, T, d]``
    (two ``nn.Linear``, so that KFAC has their Kronecker factors)."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.reshape(n, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        h = F.scaled_dot_product_attention(q, k, v)
        return self.proj(h.transpose(1, 2).reshape(n, t, d))


class EncoderBlock(nn.Module):
    """Pre-LayerNorm block: ``x + attn(ln1(x))``, then ``x + fc2(gelu(fc1(ln2(x))))``."""

    def __init__(self, d: int, heads: int, mlp: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = SelfAttention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, mlp)
        self.fc2 = nn.Linear(mlp, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))



@dataclass(frozen=True)
class Problem:
    """A test problem: data set, architecture, loss and the training set-up of the paper."""

    name: str
    dataset: str
    build: Callable[[], nn.Module]
    batch_size: int
    epochs: int
    weight_decay: float = 0.0
    augment: bool = False

    def model(self, seed: int, device: str | torch.device = "cpu") -> nn.Module:
        """The initialised network; equal seeds give equal weights, whatever the RNG state."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = self.build()
        return model.to(device)

    @staticmethod
    def loss() -> nn.Module:
        return nn.CrossEntropyLoss()

    def param_groups(self, model: nn.Module) -> list[dict]:
        """Weights get the problem's weight decay, biases none (applied by the optimizer)."""
        weights = [p for n, p in model.named_parameters() if not n.endswith("bias")]
        biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
        return [
            {"params": weights, "weight_decay": self.weight_decay},
            {"params": biases, "weight_decay": 0.0},
        ]

    def preprocess(self, augment: bool | None = None) -> Preprocess:
        """Pixels to [0, 1], per-channel standardisation for CIFAR, augmentation if enabled."""
        spec = SPECS[self.dataset]
        return Preprocess(spec.mean, spec.std, self.augment if augment is None else augment)

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return SPECS[self.dataset].shape
