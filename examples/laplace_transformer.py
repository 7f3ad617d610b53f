"""A small transformer classifier made calibrated with a Kronecker-factored Laplace approximation.

The digits of scikit-learn (8x8 images) are read as sequences of 8 tokens, one per image row,
and classified by a one-block pre-norm transformer (LayerNorm, ``scaled_dot_product_attention``,
mean pooling), trained on 100 digits with Adam until it overfits: its MAP is overconfident on
held-out digits. laplace-torch's ``KronLaplace`` then fits the posterior over all weights with
curvopt's backend (``CurvoptGGN``: the KFLR factors of every Linear/Embedding weight and the
exact blocks of the LayerNorm and bias parameters, one backward pass per batch), picks the
prior precision by the validation NLL of the linearised (GLM) predictive with the probit link
(the MAP was trained without a prior, so the marginal likelihood's prior, fitted to its
unregularised weights, is far too weak here), and predicts with that predictive. It prints the
negative log-likelihood and the expected calibration error of the MAP and of the Laplace
predictive on the held-out digits. BackPACK's and curvlinops' backends cannot factor this model.

    python examples/laplace_transformer.py            # under a minute on one core

Needs laplace-torch (``pip install --no-deps laplace-torch==0.3`` and what ``curvopt.laplace``
names) and scikit-learn.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from laplace import Laplace
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from curvopt.laplace import CurvoptGGN


class Block(nn.Module):
    """Pre-norm self-attention and MLP, both residual."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)
        )

    def forward(self, h):
        n, t, d = h.shape
        q, k, v = self.qkv(self.norm1(h)).reshape(n, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, t, d)
        h = h + self.proj(attended)
        return h + self.mlp(self.norm2(h))


class RowTransformer(nn.Module):
    """Image rows as tokens: a linear token embedding, learned positions, one block, a head."""

    def __init__(self, row: int = 8, length: int = 8, width: int = 32, classes: int = 10):
        super().__init__()
        self.embed, self.pos = nn.Linear(row, width), nn.Embedding(length, width)
        self.block, self.norm = Block(width, heads=4), nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        h = self.embed(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        return self.head(self.norm(self.block(h)).mean(1))


def digits(train: int, seed: int = 0):
    """``(x_train, y_train, x_test, y_test)``: digits as ``[N, 8 rows, 8 pixels]`` in [0, 1]."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32) / 16
    y = torch.tensor(data.target)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    return x[:train], y[:train], x[train:], y[train:]


def train_map(model, loader, epochs: int, lr: float = 1e-2):
    """Adam on the cross-entropy, no weight decay: the MAP under a flat prior (overconfident)."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(epochs):
        for x, y in loader:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    return model.eval()


def nll_and_ece(probs: torch.Tensor, y: torch.Tensor, bins: int = 10):
    """Negative log-likelihood (mean) and expected calibration error (``bins`` equal-width
    confidence bins, weighted by their share of samples)."""
    nll = -probs[torch.arange(len(y)), y].clamp_min(1e-12).log().mean().item()
    confidence, guess = probs.max(1)
    correct = (guess == y).float()
    edges = torch.linspace(0, 1, bins + 1)
    ece = 0.0
    for low, high in zip(edges[:-1], edges[1:]):
        inside = (confidence > low) & (confidence <= high)
        if inside.any():
            gap = (confidence[inside].mean() - correct[inside].mean()).abs()
            ece += inside.float().mean().item() * gap.item()
    return nll, ece


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=100, help="training digits")
    parser.add_argument("--val", type=int, default=300, help="validation digits")
    parser.add_argument("--test", type=int, default=None, help="test digits (default: the rest)")
    parser.add_argument("--epochs", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    x, y, x_rest, y_rest = digits(args.train, args.seed)
    x_val, y_val = x_rest[: args.val], y_rest[: args.val]
    test = slice(args.val, None if args.test is None else args.val + args.test)
    x_test, y_test = x_rest[test], y_rest[test]
    loader = DataLoader(TensorDataset(x, y), batch_size=50, shuffle=True)

    start = time.perf_counter()
    model = train_map(RowTransformer(), loader, args.epochs)
    trained = time.perf_counter()
    la = Laplace(
        model, "classification", subset_of_weights="all", hessian_structure="kron",
        backend=CurvoptGGN,
    )  # fmt: skip
    la.fit(DataLoader(TensorDataset(x, y), batch_size=128))
    fitted = time.perf_counter()
    la.optimize_prior_precision(
        method="gridsearch", pred_type="glm", link_approx="probit",
        val_loader=DataLoader(TensorDataset(x_val, y_val), batch_size=len(y_val)),
        log_prior_prec_min=-1, log_prior_prec_max=7, grid_size=9,
    )  # fmt: skip
    tuned = time.perf_counter()

    with torch.no_grad():
        map_probs = model(x_test).softmax(-1)
    la_probs = torch.cat(
        [la(chunk, pred_type="glm", link_approx="probit") for chunk in x_test.split(300)]
    )
    result = {
        "map": nll_and_ece(map_probs, y_test),
        "laplace": nll_and_ece(la_probs, y_test),
        "accuracy": (map_probs.argmax(1) == y_test).float().mean().item(),
        "prior_precision": la.prior_precision.item(),
    }
    print(f"{len(y)} training, {len(y_val)} validation, {len(y_test)} test digits")
    print(f"MAP accuracy {result['accuracy']:.3f}; prior precision {result['prior_precision']:.3g}")
    print(
        f"train {trained - start:.1f} s, KronLaplace fit {fitted - trained:.2f} s, "
        f"prior search {tuned - fitted:.1f} s"
    )
    print("           NLL     ECE")
    for name in ("map", "laplace"):
        nll, ece = result[name]
        print(f"{name:>7}  {nll:.4f}  {ece:.4f}")
    return result


if __name__ == "__main__":
    main()
