"""First-order quantities for whole networks: losses, reductions, architectures and graph shapes
(residuals, functional ops, modules called twice, weight tying, in-place ops, frozen parameters).
"""

import pytest
import torch
import torch.nn.functional as F
from conftest import DT, assert_close, check_against_loop, per_sample_grads_vmap
from torch import nn

# ------------------------------------------------------------------------------ architectures


def mlp():
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))


def cnn_3c3d():
    """3C3D (DeepOBS) scaled down: three conv + max-pool stages, three dense layers."""
    return nn.Sequential(
        nn.Conv2d(3, 4, 5),
        nn.ReLU(),
        nn.MaxPool2d(3, stride=2, padding=1),
        nn.Conv2d(4, 5, 3),
        nn.ReLU(),
        nn.MaxPool2d(3, stride=2, padding=1),
        nn.Conv2d(5, 6, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(3, stride=2, padding=1),
        nn.Flatten(),
        nn.Linear(6, 8),
        nn.ReLU(),
        nn.Linear(8, 6),
        nn.ReLU(),
        nn.Linear(6, 3),
    )


class PositionalEncoding(nn.Module):
    """A raw parameter used in a functional op."""

    def __init__(self, length, dim):
        super().__init__()
        self.pos = nn.Parameter(0.1 * torch.randn(length, dim))

    def forward(self, x):
        return x + self.pos[: x.shape[1]]


class TransformerBlock(nn.Module):
    """Pre-norm block: attention and MLP with residuals, LayerNorms."""

    def __init__(self, dim, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    """Token model: embedding (tied with the output layer), positions, one block, head."""

    def __init__(self, vocab=7, dim=4, length=5, tied=True):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.pos = PositionalEncoding(length, dim)
        self.block = TransformerBlock(dim, 2)
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(self.ln(self.block(self.pos(self.emb(idx))))).transpose(1, 2)  # [N, V, T]


def _classify(model_fn, x_shape, classes, n, loss, reduction):
    plain = model_fn().to(DT)
    x = torch.randn(n, *x_shape, dtype=DT)
    if loss == "ce":
        return plain, x, nn.CrossEntropyLoss(reduction=reduction), torch.randint(0, classes, (n,))
    return plain, x, nn.MSELoss(reduction=reduction), torch.randn(n, classes, dtype=DT)


@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("loss", ["ce", "mse"])
def test_mlp(loss, reduction, n, seed):
    plain, x, lossfunc, y = _classify(mlp, (6,), 3, n, loss, reduction)
    _, reference = check_against_loop(plain, lossfunc, x, y)
    for name, g in per_sample_grads_vmap(plain, lossfunc, x, y).items():
        assert_close(reference[name], g, f"loop vs vmap reference {name}")


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("loss", ["ce", "mse"])
def test_cnn_3c3d(loss, reduction, n, seed):
    plain, x, lossfunc, y = _classify(cnn_3c3d, (3, 12, 12), 3, n, loss, reduction)
    check_against_loop(plain, lossfunc, x, y)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_tiny_transformer(reduction, tied, seed):
    plain = TinyTransformer(tied=tied).to(DT).eval()
    idx = torch.randint(0, 7, (3, 5))
    y = torch.randint(0, 7, (3, 5))
    model, _ = check_against_loop(plain, nn.CrossEntropyLoss(reduction=reduction), idx, y)
    assert (model.head.weight is model.emb.weight) == tied


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_sequence_classifier(reduction, seed):
    """Linear layers on ``[N, T, D]``, cross-entropy over ``[N, C, T]`` (mean over N*T)."""
    plain = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(DT)

    class Seq(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = plain

        def forward(self, x):
            return self.net(x).transpose(1, 2)

    x = torch.randn(3, 5, 4, dtype=DT)
    y = torch.randint(0, 3, (3, 5))
    check_against_loop(Seq(), nn.CrossEntropyLoss(reduction=reduction), x, y)


# ------------------------------------------------------------------------------ graph shapes


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 5)
        self.f = nn.Sequential(nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 5))
        self.out = nn.Linear(5, 3)

    def forward(self, x):
        h = torch.sigmoid(self.inp(x)) * 2 - 0.5  # functional ops between modules
        h = h + self.f(h)
        h = torch.cat([h[:, :3], F.softplus(h[:, 3:])], dim=1)
        return self.out(h)


class CalledTwice(nn.Module):
    """The same Linear applied twice in sequence and on two branches."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.out = nn.Linear(4, 3)

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        h = self.fc(h) + self.norm(x)
        h = self.norm(h)
        return self.out(h)


class ConvCalledTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(2, 2, 3, padding=1)
        self.out = nn.Linear(10, 2)

    def forward(self, x):
        return self.out(self.conv(torch.relu(self.conv(x))).flatten(1))


class TiedLinear(nn.Module):
    """Two Linear layers sharing one weight (autoencoder-style tying via the same Parameter)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4, bias=False)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class TiedEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(6, 4)
        self.out = nn.Linear(4, 6)
        self.out.weight = self.emb.weight

    def forward(self, idx):
        return self.out(torch.tanh(self.emb(idx))).mean(1)


class InplaceNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3)
        self.act1 = nn.ReLU(inplace=True)
        self.bn = nn.BatchNorm2d(3).eval()
        self.act2 = nn.ReLU(inplace=True)
        self.fc1 = nn.Linear(12, 5)
        self.act3 = nn.ReLU(inplace=True)
        self.fc2 = nn.Linear(5, 3)

    def forward(self, x):
        h = self.act2(self.bn(self.act1(self.conv(x))))
        h = self.fc1(h.flatten(1))
        h.mul_(2).add_(0.1)  # in-place functional ops on a module output
        return self.fc2(self.act3(h))


class Frozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 5)
        self.b = nn.Linear(5, 5)
        self.c = nn.Conv1d(1, 2, 2)
        self.d = nn.Linear(8, 3)
        self.a.weight.requires_grad_(False)
        self.b.requires_grad_(False)
        self.c.bias.requires_grad_(False)

    def forward(self, x):
        h = self.b(torch.tanh(self.a(x)))
        return self.d(self.c(h.unsqueeze(1)).flatten(1))


def _inputs(model_cls):
    if model_cls is TiedEmbedding:
        return torch.randint(0, 6, (4, 5))
    if model_cls is InplaceNet:
        return torch.randn(4, 2, 4, 4, dtype=DT)
    if model_cls is ConvCalledTwice:
        return torch.randn(4, 2, 5, dtype=DT)
    return torch.randn(4, 4, dtype=DT)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize(
    "model_cls",
    [Residual, CalledTwice, ConvCalledTwice, TiedLinear, TiedEmbedding, InplaceNet, Frozen],
)
def test_graph_shapes(model_cls, reduction, seed):
    plain = model_cls().to(DT)
    if model_cls is InplaceNet:
        with torch.no_grad():
            plain.bn.running_mean.uniform_(-0.5, 0.5)
            plain.bn.running_var.uniform_(0.5, 2)
    x = _inputs(model_cls)
    with torch.no_grad():
        out = plain(x)
    y = torch.randint(0, out.shape[1], (x.shape[0],))
    check_against_loop(plain, nn.CrossEntropyLoss(reduction=reduction), x, y)


def test_frozen_parameters_get_nothing(seed):
    plain = Frozen().to(DT)
    model, _ = check_against_loop(
        plain, nn.MSELoss(), torch.randn(3, 4, dtype=DT), torch.randn(3, 3, dtype=DT)
    )
    for p in (model.a.weight, model.b.weight, model.b.bias, model.c.bias):
        assert not any(
            hasattr(p, a) for a in ("grad_batch", "batch_l2", "sum_grad_squared", "variance")
        )


def test_two_forward_passes_one_backward(seed):
    """Two forwards of the same model (e.g. two views of a batch) summed into one loss."""

    class Twin(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def forward(self, x1, x2):
            return self.net(x1) + 0.5 * self.net(x2)

    plain = Twin().to(DT)
    x1, x2 = torch.randn(3, 6, dtype=DT), torch.randn(3, 6, dtype=DT)
    check_against_loop(plain, nn.MSELoss(), (x1, x2), torch.randn(3, 3, dtype=DT))


def test_mse_on_images(seed):
    """MSE with mean over ``N * C * H * W``: a conv autoencoder-style network."""
    plain = nn.Sequential(
        nn.Conv2d(2, 3, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.ConvTranspose2d(3, 2, 3, stride=2, padding=1, output_padding=1),
    ).to(DT)
    x = torch.randn(3, 2, 4, 4, dtype=DT)
    check_against_loop(plain, nn.MSELoss(), x, torch.randn_like(x))
