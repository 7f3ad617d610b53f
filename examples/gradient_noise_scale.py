"""The gradient noise scale B_simple = tr(Σ) / |G|² over training (McCandlish et al., 2018).

``Σ`` is the covariance of the per-example gradients and ``G`` the true gradient. ``B_simple``
estimates the *critical batch size*: below it, doubling the batch nearly halves the number of
steps to a given loss; far above it, larger batches only waste compute. One backward pass with
``Variance`` gives everything per step:

* ``Variance`` is the element-wise variance of the rows of ``grad_batch`` (population
  convention, ``1/N``). Rows are ``g_n / N`` with ``reduction="mean"`` (``g_n`` with
  ``"sum"``), so the unbiased ``tr Σ = N/(N-1) · s² · Σ variance``, ``s = N`` (mean) or 1 (sum);
* the mini-batch mean ``G_B`` of the ``g_n`` has ``E|G_B|² = |G|² + tr Σ / N``, so
  ``|G|² ≈ |G_B|² - tr Σ / N`` is unbiased.

Both estimates are noisy per step; as McCandlish et al. (Appendix A) advise, their exponential
moving averages are taken before dividing. ``SumGradSquared`` gives the same numbers
(``Σ_n |g_n|² = s² Σ sum_grad_squared``); the test checks both against a loop over samples.

    python examples/gradient_noise_scale.py                  # sklearn digits, ~10 s on 2 cores
    python examples/gradient_noise_scale.py --dataset mnist  # 10 000 MNIST images (./data)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

import curvopt
from curvopt import extensions as ext


def noise_scale_terms(model: nn.Module, batch_size: int, reduction: str = "mean") -> dict:
    """After a backward pass inside ``curvopt.collect(Variance())``: unbiased ``tr Σ`` of the
    per-example gradients, ``|G_B|²`` of the batch mean, unbiased ``|G|²`` and their ratio."""
    n = batch_size
    if n < 2:
        raise ValueError("the noise scale needs at least 2 examples per batch")
    s = float(n) if reduction == "mean" else 1.0
    params = [p for p in model.parameters() if p.requires_grad and p.grad is not None]
    var_sum = sum(p.variance.double().sum() for p in params)
    tr_sigma = n / (n - 1) * s**2 * var_sum
    mean_grad_sq = sum(((p.grad.double() * s / n) ** 2).sum() for p in params)
    g2 = mean_grad_sq - tr_sigma / n
    return {
        "tr_sigma": float(tr_sigma),
        "batch_grad_sq": float(mean_grad_sq),
        "grad_sq": float(g2),
        "b_simple": float(tr_sigma / g2) if g2 > 0 else float("inf"),
    }


def noise_scale_terms_sgs(model: nn.Module, batch_size: int, reduction: str = "mean") -> dict:
    """The same from ``SumGradSquared``: ``tr Σ = (Σ_n |g_n|² - N |G_B|²) / (N - 1)``."""
    n = batch_size
    s = float(n) if reduction == "mean" else 1.0
    params = [p for p in model.parameters() if p.requires_grad and p.grad is not None]
    sum_sq = s**2 * sum(p.sum_grad_squared.double().sum() for p in params)
    mean_grad_sq = sum(((p.grad.double() * s / n) ** 2).sum() for p in params)
    tr_sigma = (sum_sq - n * mean_grad_sq) / (n - 1)
    g2 = mean_grad_sq - tr_sigma / n
    return {
        "tr_sigma": float(tr_sigma),
        "batch_grad_sq": float(mean_grad_sq),
        "grad_sq": float(g2),
        "b_simple": float(tr_sigma / g2) if g2 > 0 else float("inf"),
    }


class EMA:
    """Bias-corrected exponential moving average."""

    def __init__(self, beta: float):
        self.beta, self.value, self.steps = beta, 0.0, 0

    def update(self, x: float) -> float:
        self.steps += 1
        self.value = self.beta * self.value + (1 - self.beta) * x
        return self.value / (1 - self.beta**self.steps)


def load_data(name: str, n_train: int = 10_000, seed: int = 0):
    """``(X_train, y_train, X_test, y_test)``: flattened images in [0, 1]."""
    if name == "digits":
        from sklearn.datasets import load_digits

        d = load_digits()
        X = torch.tensor(d.data, dtype=torch.float32) / 16.0
        y = torch.tensor(d.target)
        perm = torch.randperm(len(X), generator=torch.Generator().manual_seed(seed))
        return X[perm[360:]], y[perm[360:]], X[perm[:360]], y[perm[:360]]
    root = Path(__file__).resolve().parents[1]
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from experiments.data import load_dataset

    d = load_dataset("mnist")
    idx = torch.randperm(len(d.train_y), generator=torch.Generator().manual_seed(seed))[:n_train]
    flat = lambda x: x.flatten(1).float() / 255.0  # noqa: E731
    return flat(d.train_x[idx]), d.train_y[idx], flat(d.test_x[:2000]), d.test_y[:2000]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", choices=["digits", "mnist"], default="digits")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--ema", type=float, default=0.95, help="EMA factor of numerator/denominator")
    p.add_argument("--print-every", type=int, default=40, help="steps between lines")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # small matrices: a second thread only waits (worse on a busy machine)
    t0 = time.perf_counter()
    X, y, Xt, yt = load_data(args.dataset, seed=args.seed)
    torch.manual_seed(args.seed)
    model = curvopt.extend(nn.Sequential(nn.Linear(X.shape[1], 128), nn.ReLU(), nn.Linear(128, 10)))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    tr_ema, g2_ema = EMA(args.ema), EMA(args.ema)
    gen = torch.Generator().manual_seed(args.seed)
    print(
        f"{args.dataset}: {len(X)} training examples, batch size {args.batch_size}, "
        f"SGD lr {args.lr}; B_simple = EMA(tr Σ) / EMA(|G|²), EMA factor {args.ema}"
    )
    print(
        f"{'step':>5} {'epoch':>5} {'loss':>7} {'test acc':>8} {'|G_B|²':>9} {'tr Σ':>9} "
        f"{'|G|² est.':>10} {'B_simple':>9}"
    )
    step, history = 0, []
    for epoch in range(args.epochs):
        for idx in torch.randperm(len(X), generator=gen).split(args.batch_size):
            if len(idx) < 2:
                continue
            opt.zero_grad()
            loss = lossfunc(model(X[idx]), y[idx])
            with curvopt.collect(ext.Variance()):
                loss.backward()
            t = noise_scale_terms(model, len(idx))
            tr, g2 = tr_ema.update(t["tr_sigma"]), g2_ema.update(t["grad_sq"])
            opt.step()
            step += 1
            history.append((t["tr_sigma"], t["grad_sq"]))
            if step % args.print_every == 0:
                with torch.no_grad():
                    acc = (model(Xt).argmax(1) == yt).float().mean().item()
                b = f"{tr / g2:9.1f}" if g2 > 0 else "      inf"
                print(
                    f"{step:>5} {epoch:>5} {loss.item():>7.4f} {acc:>8.3f} "
                    f"{t['batch_grad_sq']:>9.4f} {tr:>9.3f} {g2:>10.4f} {b}"
                )
    third = max(1, len(history) // 3)
    first, last = (
        sum(h[0] for h in part) / max(1e-12, sum(h[1] for h in part))
        for part in (history[:third], history[-third:])
    )
    print(
        f"B_simple from the averaged terms: first third of training {first:.0f}, last third "
        f"{last:.0f} (batch size {args.batch_size}). McCandlish et al. find it growing as the "
        "loss falls (the gradient shrinks faster than its noise), i.e. larger batches pay off "
        f"later in training. {time.perf_counter() - t0:.1f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
