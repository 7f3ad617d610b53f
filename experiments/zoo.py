"""A zoo of tiny models written the way users write them, for differential tests and benchmarks.

Every factory returns a :class:`Problem` ``(model, lossfunc, make_batch, loss_of)`` plus two
fields for references:

* ``model``: a plain ``nn.Module`` (not extended; the caller decides), parameters in ``dtype``;
* ``lossfunc``: the plain loss module (``reduction`` as asked);
* ``make_batch(N, seed) -> (X, y)``: a deterministic batch of ``N`` samples;
* ``loss_of(model, X, y)``: the loss exactly as users compute it, e.g.
  ``lossfunc(model(X).reshape(-1, V), y.reshape(-1))``;
* ``loss_on(out, y)``: the same loss from a model output ``out = model(X)`` (``loss_of`` is
  ``loss_on(model(X), y)``), so references can differentiate w.r.t. the output.
  Both take an optional ``lossfunc=`` to use instead of the problem's (e.g. an extended copy);
* ``batch_dim``: the sample axis of ``X``, of ``model(X)`` and of ``y`` (1 for sequence-first).

Sizes are tiny (``d_model`` 8, sequences of 4, vocabularies of 7) so that torch.func references
with full Jacobians stay cheap. Example::

    model, lossfunc, make_batch, loss_of = zoo.gpt()
    X, y = make_batch(4, seed=0)
    loss_of(model, X, y).backward()
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

Batch = tuple[torch.Tensor, torch.Tensor]


class Problem(NamedTuple):
    model: nn.Module
    lossfunc: nn.Module
    make_batch: Callable[[int, int], Batch]
    loss_of: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    loss_on: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    batch_dim: int = 0


def _problem(model, lossfunc, make_batch, loss_on, batch_dim=0, dtype=torch.float64) -> Problem:
    def loss_of(module, X, y, lossfunc=None):
        return loss_on(module(X), y, lossfunc)

    return Problem(model.to(dtype), lossfunc, make_batch, loss_of, loss_on, batch_dim)


def _flat_ce(lossfunc: nn.Module) -> Callable:
    """``lossfunc(logits.reshape(-1, V), y.reshape(-1))``: the language-model loss."""

    def loss_on(logits, y, other=None):
        return (lossfunc if other is None else other)(
            logits.reshape(-1, logits.shape[-1]), y.reshape(-1)
        )

    return loss_on


def _plain(lossfunc: nn.Module) -> Callable:
    """``lossfunc(out, y)``."""

    def loss_on(out, y, other=None):
        return (lossfunc if other is None else other)(out, y)

    return loss_on


def _seeded(build: Callable[..., nn.Module], *args, **kwargs) -> nn.Module:
    """``build(*args, **kwargs)`` initialised from seed 0, leaving the global RNG untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return build(*args, **kwargs)


def _images(classes: int, dtype) -> Callable:
    """``make_batch(n, seed)``: images ``[n, 2, 4, 4]`` and class labels."""

    def make_batch(n: int, seed: int = 0) -> Batch:
        g = _generator(seed)
        images = torch.randn(n, 2, 4, 4, generator=g, dtype=dtype)
        return images, torch.randint(0, classes, (n,), generator=g)

    return make_batch


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------ building blocks


class CausalSelfAttention(nn.Module):
    """``proj(softmax(q kᵀ/√d_h + mask) v)``, ``q, k, v = split(qkv(x))``, ``x: [N, T, d]``."""

    def __init__(self, d: int, heads: int, causal: bool = True):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x, mask=None):
        n, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.reshape(n, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        h = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal)
        return self.proj(h.transpose(1, 2).reshape(n, t, d))


class Block(nn.Module):
    """Pre-LayerNorm transformer block ``x + attn(ln1(x))``, then ``+ mlp(ln2(·))`` (GELU).

    ``ln2`` has no bias (``nn.LayerNorm(bias=False)``, as in recent GPT code)."""

    def __init__(self, d: int, heads: int, causal: bool):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads, causal)
        self.ln2 = nn.LayerNorm(d, bias=False)
        self.fc = nn.Linear(d, 2 * d)
        self.out = nn.Linear(2 * d, d)

    def forward(self, x, mask=None):
        x = x + self.attn(self.ln1(x), mask)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


# ------------------------------------------------------------------------------ GPT


class GPT(nn.Module):
    """Decoder-only language model, ``idx [N, T] -> logits [N, T, V]``.

    Token embedding plus learned positions looked up with one shared ``arange(T)`` (broadcast
    over the batch), one causal block, a final LayerNorm and an output layer tied to the token
    embedding: ``nn.Linear`` whose weight *is* ``tok.weight`` (``tied_linear=True``) or the
    functional ``h @ tok.weight.T`` (``tied_linear=False``).
    """

    def __init__(
        self, vocab: int = 7, d: int = 8, heads: int = 2, t_max: int = 4, tied_linear=True
    ):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        nn.init.normal_(self.tok.weight, std=0.3)  # tied logits of order one
        self.pos = nn.Embedding(t_max, d)
        self.block = Block(d, heads, causal=True)
        self.ln_f = nn.LayerNorm(d)
        self.head = None
        if tied_linear:
            self.head = nn.Linear(d, vocab, bias=False)
            self.head.weight = self.tok.weight

    def forward(self, idx):
        positions = torch.arange(idx.shape[1], device=idx.device)
        h = self.ln_f(self.block(self.tok(idx) + self.pos(positions)))
        return self.head(h) if self.head is not None else h @ self.tok.weight.T


def gpt(
    reduction: str = "mean",
    tied_linear: bool = True,
    vocab: int = 7,
    T: int = 4,
    dtype=torch.float64,
) -> Problem:
    """GPT-style decoder; targets are the next tokens, the last position of sample 0 ignored
    (``-100``); loss ``CrossEntropyLoss(reduction)(logits.reshape(-1, V), y.reshape(-1))``."""
    model = _seeded(GPT, vocab=vocab, t_max=T, tied_linear=tied_linear)
    lossfunc = nn.CrossEntropyLoss(reduction=reduction)

    def make_batch(n: int, seed: int = 0) -> Batch:
        tokens = torch.randint(0, vocab, (n, T + 1), generator=_generator(seed))
        y = tokens[:, 1:].clone()
        y[0, -1] = -100
        return tokens[:, :-1], y

    return _problem(model, lossfunc, make_batch, _flat_ce(lossfunc), dtype=dtype)


def gpt_functional(reduction: str = "mean", **kwargs) -> Problem:
    """:func:`gpt` with the functional tied head ``h @ tok.weight.T``."""
    return gpt(reduction, tied_linear=False, **kwargs)


# ------------------------------------------------------------------------------ BERT


class BERT(nn.Module):
    """Encoder with a padding mask and an MLM head, ``idx [N, T] -> logits [N, T, V]``.

    Token ``PAD = 0`` is never attended to (boolean ``attn_mask [N, 1, 1, T]`` of
    ``scaled_dot_product_attention``); learned positions via a shared ``arange(T)``.
    """

    PAD = 0

    def __init__(self, vocab: int = 7, d: int = 8, heads: int = 2, t_max: int = 4):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(t_max, d)
        self.block = Block(d, heads, causal=False)
        self.mlm = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.LayerNorm(d), nn.Linear(d, vocab))

    def forward(self, idx):
        keep = (idx != self.PAD)[:, None, None, :]
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.mlm(self.block(self.tok(idx) + self.pos(positions), keep))


def bert(reduction: str = "mean", vocab: int = 7, T: int = 4, dtype=torch.float64) -> Problem:
    """BERT-style MLM: position 1 of every sequence is replaced by ``MASK = V - 1`` and predicted
    (targets ``-100`` elsewhere); odd samples end in one ``PAD`` token."""
    model = _seeded(BERT, vocab=vocab, t_max=T)
    lossfunc = nn.CrossEntropyLoss(reduction=reduction)

    def make_batch(n: int, seed: int = 0) -> Batch:
        tokens = torch.randint(1, vocab - 1, (n, T), generator=_generator(seed))
        y = torch.full_like(tokens, -100)
        y[:, 1] = tokens[:, 1]
        idx = tokens.clone()
        idx[:, 1] = vocab - 1
        idx[1::2, -1] = BERT.PAD
        return idx, y

    return _problem(model, lossfunc, make_batch, _flat_ce(lossfunc), dtype=dtype)


# ------------------------------------------------------------------------------ ViT


class ViT(nn.Module):
    """Vision transformer, ``images [N, 2, 4, 4] -> logits [N, classes]``.

    Patch ``Conv2d`` (2x2 patches), a learned class token broadcast by ``cls.expand(N, -1, -1)``,
    learned positions, ``nn.MultiheadAttention(batch_first=True)`` called as users do
    (``attn(x, x, x)[0]``, default ``need_weights=True``), a GELU MLP, the class token's head.
    """

    def __init__(self, channels: int = 2, d: int = 8, heads: int = 2, classes: int = 3):
        super().__init__()
        self.patch = nn.Conv2d(channels, d, kernel_size=2, stride=2)
        self.cls = nn.Parameter(0.1 * torch.randn(1, 1, d))
        self.pos = nn.Parameter(0.1 * torch.randn(1, 5, d))
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.head = nn.Linear(d, classes)

    def forward(self, images):
        x = self.patch(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        h = self.ln1(x)
        x = x + self.attn(h, h, h)[0]
        x = x + self.mlp(self.ln2(x))
        return self.head(x[:, 0])


def vit(reduction: str = "mean", classes: int = 3, dtype=torch.float64) -> Problem:
    """ViT-style classifier, ``CrossEntropyLoss(reduction)(logits, y)``."""
    model = _seeded(ViT, classes=classes)
    lossfunc = nn.CrossEntropyLoss(reduction=reduction)

    return _problem(model, lossfunc, _images(classes, dtype), _plain(lossfunc), dtype=dtype)


# ------------------------------------------------------------------------------ sequence-first


class SeqFirstEncoder(nn.Module):
    """``x [T, N, D] -> logits [T, N, V]`` via ``nn.TransformerEncoder(batch_first=False)``."""

    def __init__(self, d_in: int = 3, d: int = 8, heads: int = 2, vocab: int = 5):
        super().__init__()
        self.embed = nn.Linear(d_in, d)
        layer = nn.TransformerEncoderLayer(d, heads, dim_feedforward=16, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x)))


def seq_first(reduction: str = "mean", T: int = 4, vocab: int = 5, dtype=torch.float64) -> Problem:
    """Sequence-first encoder; ``X [T, N, 3]``, ``y [T, N]``, flattened CE: ``batch_dim = 1``."""
    model = _seeded(SeqFirstEncoder, vocab=vocab)
    lossfunc = nn.CrossEntropyLoss(reduction=reduction)

    def make_batch(n: int, seed: int = 0) -> Batch:
        g = _generator(seed)
        x = torch.randn(T, n, 3, generator=g, dtype=dtype)
        return x, torch.randint(0, vocab, (T, n), generator=g)

    return _problem(model, lossfunc, make_batch, _flat_ce(lossfunc), batch_dim=1, dtype=dtype)


# ------------------------------------------------------------------------------ ResNet block


class ResNetBlock(nn.Module):
    """``relu(x + bn2(conv2(relu(bn1(conv1(x))))))`` after a stem conv, then pool and head.

    The BatchNorms are in eval mode with non-trivial running statistics."""

    def __init__(self, channels: int = 2, width: int = 4, classes: int = 3):
        super().__init__()
        self.stem = nn.Conv2d(channels, width, 3, padding=1)
        self.conv1 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.head = nn.Linear(width, classes)
        for bn in (self.bn1, self.bn2):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
            nn.init.uniform_(bn.weight, 0.5, 1.5)
            nn.init.uniform_(bn.bias, -0.5, 0.5)
            bn.eval()

    def train(self, mode: bool = True):
        super().train(mode)
        self.bn1.eval()
        self.bn2.eval()
        return self

    def forward(self, x):
        x = self.stem(x)
        h = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(x + self.bn2(self.conv2(h)))
        return self.head(x.mean((2, 3)))


def resnet_block(reduction: str = "mean", classes: int = 3, dtype=torch.float64) -> Problem:
    """ResNet basic block on ``[N, 2, 4, 4]`` images, ``CrossEntropyLoss(reduction)``."""
    model = _seeded(ResNetBlock, classes=classes)
    lossfunc = nn.CrossEntropyLoss(reduction=reduction)

    return _problem(model, lossfunc, _images(classes, dtype), _plain(lossfunc), dtype=dtype)


# ------------------------------------------------------------------------------ MLP


def mlp(reduction: str = "mean", classes: int = 3, dtype=torch.float64) -> Problem:
    """``Linear(4, 6) - Tanh - Linear(6, 3)``, ``CrossEntropyLoss(reduction)``."""
    model = _seeded(lambda: nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, classes)))
    lossfunc = nn.CrossEntropyLoss(reduction=reduction)

    def make_batch(n: int, seed: int = 0) -> Batch:
        g = _generator(seed)
        return torch.randn(n, 4, generator=g, dtype=dtype), torch.randint(
            0, classes, (n,), generator=g
        )

    return _problem(model, lossfunc, make_batch, _plain(lossfunc), dtype=dtype)


#: name -> factory(reduction=...)
ZOO: dict[str, Callable[..., Problem]] = {
    "mlp": mlp,
    "resnet_block": resnet_block,
    "gpt": gpt,
    "gpt_functional": gpt_functional,
    "bert": bert,
    "vit": vit,
    "seq_first": seq_first,
}
