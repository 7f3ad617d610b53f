"""Gradient-similarity data attribution (TracIn): which training examples drove a prediction?

TracIn (Pruthi et al., 2020) scores a training example ``z`` for a test example ``z'`` by the
dot products of their loss gradients at checkpoints ``θ_k`` of training, weighted by the
learning rate:

    TracInCP(z, z') = Σ_k η_k ⟨∇ℓ(θ_k, z), ∇ℓ(θ_k, z')⟩

Positive scores are *proponents* (a step on ``z`` lowers the test loss), negative ones
*opponents*. The gradients of all training examples come from ``BatchGrad``, a batch at a time,
in one backward pass each; *self-influence* ``Σ_k η_k ‖∇ℓ(θ_k, z)‖²`` needs only ``BatchL2Grad``
(never materialises a per-sample gradient) and finds mislabelled training examples.
The losses use ``reduction="sum"``, so that ``grad_batch`` rows are the per-example gradients
(with ``"mean"`` they would carry a factor ``1 / batch size``).

    python examples/gradient_attribution.py                  # sklearn digits, ~10 s on 2 cores
    python examples/gradient_attribution.py --png attr.png   # also draw the examples

Trains a small network on digits with 5% of the training labels flipped, saving a checkpoint
per epoch; then prints, for a few test digits, the most influential training examples, and
how many flipped labels are among the training examples of highest self-influence.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
from torch import nn

import curvopt
from curvopt import extensions as ext


# --- scores -------------------------------------------------------------------------------------


def _trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def test_gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """Gradient of the loss of the single example ``(x, y)`` (plain autograd)."""
    loss = nn.functional.cross_entropy(model(x.unsqueeze(0)), y.view(1), reduction="sum")
    return list(torch.autograd.grad(loss, _trainable(model)))


def gradient_similarity(
    model: nn.Module,
    X: torch.Tensor,
    y: torch.Tensor,
    directions: list[list[torch.Tensor]],
    batch_size: int = 512,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dots [len(directions), n], sq_norms [n])``: per training example ``n`` the dot
    products of its loss gradient with each direction (e.g. test gradients), and its squared
    norm. ``model`` must be ``curvopt.extend``-ed."""
    lossfunc = curvopt.extend(nn.CrossEntropyLoss(reduction="sum"))
    params = _trainable(model)
    dots = torch.zeros(len(directions), len(X), dtype=params[0].dtype)
    sq_norms = torch.zeros(len(X), dtype=params[0].dtype)
    for idx in torch.arange(len(X)).split(batch_size):
        model.zero_grad(set_to_none=True)
        loss = lossfunc(model(X[idx]), y[idx])
        with curvopt.collect(ext.BatchGrad(), ext.BatchL2Grad()):
            loss.backward()
        for k, direction in enumerate(directions):
            dots[k, idx] = sum(
                torch.einsum("n...,...->n", p.grad_batch, d) for p, d in zip(params, direction)
            ).detach()
        sq_norms[idx] = sum(p.batch_l2 for p in params).detach()
        for p in params:
            p.grad_batch = None
            p.batch_l2 = None
    model.zero_grad(set_to_none=True)
    return dots, sq_norms


def tracin(
    checkpoints: list[tuple[nn.Module, float]],
    X_train: torch.Tensor,
    y_train: torch.Tensor,
    X_test: torch.Tensor,
    y_test: torch.Tensor,
    batch_size: int = 512,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TracInCP over ``checkpoints`` (``(model, learning rate)`` pairs):
    ``(influence [n_test, n_train], self_influence [n_train])``."""
    influence = torch.zeros(len(X_test), len(X_train))
    self_influence = torch.zeros(len(X_train))
    for model, lr in checkpoints:
        directions = [test_gradient(model, x, t) for x, t in zip(X_test, y_test)]
        dots, sq = gradient_similarity(model, X_train, y_train, directions, batch_size)
        influence += lr * dots.to(influence.dtype)
        self_influence += lr * sq.to(self_influence.dtype)
    return influence, self_influence


# --- data, training -----------------------------------------------------------------------------


def load_digits_split(seed: int = 0, flip: float = 0.05):
    """Digits, 360 test images, ``flip`` of the training labels replaced by another class."""
    from sklearn.datasets import load_digits

    d = load_digits()
    X = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target)
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(X), generator=gen)
    test, train = perm[:360], perm[360:]
    y_train = y[train].clone()
    flipped = torch.randperm(len(train), generator=gen)[: int(flip * len(train))]
    shift = torch.randint(1, 10, (len(flipped),), generator=gen)
    y_train[flipped] = (y_train[flipped] + shift) % 10
    is_flipped = torch.zeros(len(train), dtype=torch.bool)
    is_flipped[flipped] = True
    return X[train], y_train, X[test], y[test], is_flipped, y[train]


def train_with_checkpoints(X, y, epochs: int, lr: float, batch_size: int, seed: int):
    torch.manual_seed(seed)
    model = curvopt.extend(nn.Sequential(nn.Linear(X.shape[1], 64), nn.Tanh(), nn.Linear(64, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    checkpoints = []
    for _ in range(epochs):
        for idx in torch.randperm(len(X), generator=gen).split(batch_size):
            opt.zero_grad()
            nn.functional.cross_entropy(model(X[idx]), y[idx]).backward()
            opt.step()
        checkpoints.append((curvopt.extend(copy.deepcopy(model)), lr))  # a copy is plain
    return model, checkpoints


def _draw(path: Path, X_test, y_test, pred, picks, influence, X_train, y_train, k):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(1.3 * (2 * k + 1), 1.6 * len(picks)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(picks), 2 * k + 1, squeeze=False)
    for row, i in enumerate(picks):
        order = influence[row].argsort(descending=True)
        cells = [("test", X_test[i], f"test: {int(y_test[i])}\npred {int(pred[i])}", "black")]
        cells += [
            ("pro", X_train[j], f"+{influence[row, j]:.2f}\nlabel {int(y_train[j])}", "green")
            for j in order[:k]
        ]
        cells += [
            ("opp", X_train[j], f"{influence[row, j]:.2f}\nlabel {int(y_train[j])}", "red")
            for j in order[-k:].flip(0)
        ]
        for ax, (_, img, title, color) in zip(axes[row], cells):
            ax.imshow(img.view(8, 8), cmap="gray_r")
            ax.set_title(title, fontsize=7, color=color)
            ax.set_xticks([])
            ax.set_yticks([])
    fig.suptitle(
        f"TracInCP: test digit | {k} top proponents (green) | {k} top opponents (red)", fontsize=9
    )
    fig.savefig(path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--top", type=int, default=5, help="proponents/opponents shown per example")
    p.add_argument("--flip", type=float, default=0.05, help="share of training labels flipped")
    p.add_argument("--png", type=Path, help="draw the test digits and their top examples")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # small matrices: a second thread only waits (worse on a busy machine)
    t0 = time.perf_counter()
    X, y, Xt, yt, is_flipped, y_clean = load_digits_split(args.seed, args.flip)
    model, checkpoints = train_with_checkpoints(
        X, y, args.epochs, args.lr, args.batch_size, args.seed
    )
    with torch.no_grad():
        pred = model(Xt).argmax(1)
    print(
        f"digits: {len(X)} training examples ({int(is_flipped.sum())} with flipped labels), "
        f"{len(Xt)} test; test accuracy {(pred == yt).float().mean():.3f} after "
        f"{args.epochs} epochs"
    )
    wrong = (pred != yt).nonzero().flatten().tolist()
    right = (pred == yt).nonzero().flatten().tolist()
    picks = right[:2] + wrong[:2]
    influence, self_inf = tracin(checkpoints, X, y, Xt[picks], yt[picks])
    for row, i in enumerate(picks):
        order = influence[row].argsort(descending=True)

        def fmt(js, row=row):
            return ", ".join(
                f"#{j} (label {int(y[j])}"
                + (f"*, really {int(y_clean[j])}" if is_flipped[j] else "")
                + f", {influence[row, j]:+.2f})"
                for j in js.tolist()
            )

        print(f"\ntest #{i}: true {int(yt[i])}, predicted {int(pred[i])}")
        print(f"  proponents: {fmt(order[: args.top])}")
        print(f"  opponents:  {fmt(order[-args.top :].flip(0))}")
    n_flip = int(is_flipped.sum())
    top = self_inf.argsort(descending=True)[:n_flip]
    found = int(is_flipped[top].sum())
    print(
        f"\n(* = flipped label) Self-influence Σ_k η_k ‖g_k(z)‖² (BatchL2Grad only): "
        f"{found} of the {n_flip} flipped labels are among the {n_flip} training examples "
        f"with the highest self-influence (random ranking: ~{n_flip * n_flip / len(X):.1f})."
    )
    if args.png:
        _draw(args.png, Xt, yt, pred, picks, influence, X, y, args.top)
        print(f"drawn: {args.png}")
    print(f"{time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
