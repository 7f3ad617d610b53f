"""DP-SGD: per-sample gradient clipping and Gaussian noise from one backward pass.

DP-SGD (Abadi et al., 2016) replaces the mini-batch gradient by

    g̃ = ( Σ_n g_n · min(1, C / ‖g_n‖)  +  N(0, σ² C² I) ) / B

where ``g_n`` is the gradient of sample ``n``'s own loss, ``C`` the clipping norm, ``σ`` the noise
multiplier and ``B`` the batch size. curvopt gives everything in one backward pass:
``BatchL2Grad`` the squared norms ``‖g_n‖²`` (summed over parameters) and ``BatchGrad`` the
``g_n`` themselves. Note the loss convention (docs/conventions.md): with ``reduction="mean"``
the rows of ``grad_batch`` are ``g_n / B`` and ``batch_l2`` is ``‖g_n‖² / B²``; they are
rescaled here.

    python examples/dp_sgd_clipping.py                   # sklearn digits, ~10 s on 2 cores
    python examples/dp_sgd_clipping.py --dataset mnist   # 10 000 MNIST images (./data)

Trains the same network three times (plain SGD, clipping only, clipping + noise) and prints
test accuracy and how many samples were clipped. There is no privacy accounting here: the
(ε, δ) of a run follows from σ, the sampling rate B / n and the number of steps with an RDP
accountant (e.g. Opacus's); shuffled batches, as used here, are not Poisson sampling.
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


# --- the DP-SGD gradient ------------------------------------------------------------------------


def _per_sample_scale(lossfunc: nn.Module, batch_size: int) -> float:
    """Factor that turns ``grad_batch`` rows into per-sample loss gradients ``g_n``."""
    reduction = getattr(lossfunc, "reduction", "mean")
    if reduction == "mean":
        return float(batch_size)
    if reduction == "sum":
        return 1.0
    raise ValueError(f"loss reduction {reduction!r}: use 'mean' or 'sum'")


def per_sample_gradients(model, lossfunc, X, y):
    """One backward pass: ``(params, [g_n per param], ‖g_n‖ over all params)``.

    ``g_n`` is the gradient of sample ``n``'s own loss (``[N, *p.shape]`` per parameter); the
    norms come from ``BatchL2Grad`` (no second pass over ``grad_batch``).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    loss = lossfunc(model(X), y)
    with curvopt.collect(ext.BatchGrad(), ext.BatchL2Grad()):
        loss.backward()
    scale = _per_sample_scale(lossfunc, len(X))
    grads = [p.grad_batch * scale for p in params]
    sq_norms = sum(p.batch_l2 for p in params) * scale**2
    return params, grads, sq_norms.clamp(min=0).sqrt()


def clip_factors(norms: torch.Tensor, clip_norm: float, eps: float = 1e-6) -> torch.Tensor:
    """``min(1, C / ‖g_n‖)`` (with Opacus's ``eps`` against division by zero)."""
    return (clip_norm / (norms + eps)).clamp(max=1.0)


def dp_gradient(
    model: nn.Module,
    lossfunc: nn.Module,
    X: torch.Tensor,
    y: torch.Tensor,
    clip_norm: float,
    noise_multiplier: float,
    generator: torch.Generator | None = None,
) -> dict:
    """Write DP-SGD's noisy clipped mean gradient into ``p.grad`` of every trainable parameter.

    Returns ``{"norms": ‖g_n‖ before clipping, "clipped": fraction of samples clipped,
    "loss": the batch loss}``; any ``torch.optim`` optimizer then takes the DP step.
    Noise is drawn from ``generator`` (the global one if ``None``), parameter by parameter in
    ``model.parameters()`` order.
    """
    if clip_norm <= 0 or noise_multiplier < 0:
        raise ValueError("need clip_norm > 0 and noise_multiplier >= 0")
    n = len(X)
    params, grads, norms = per_sample_gradients(model, lossfunc, X, y)
    factor = clip_factors(norms, clip_norm)
    for p, g in zip(params, grads):
        clipped_sum = torch.einsum("n,n...->...", factor.to(g.dtype), g)
        if noise_multiplier > 0:
            noise = torch.randn(p.shape, generator=generator, dtype=p.dtype, device=p.device)
            clipped_sum = clipped_sum + noise_multiplier * clip_norm * noise
        p.grad = clipped_sum / n
    for p in params:  # drop the per-sample buffers so curvopt can recycle them
        p.grad_batch = None
        p.batch_l2 = None
    return {"norms": norms.detach(), "clipped": (factor < 1).float().mean().item()}


# --- data ---------------------------------------------------------------------------------------


def load_data(name: str, n_train: int = 10_000, seed: int = 0):
    """``(X_train, y_train, X_test, y_test)`` as float tensors in [0, 1], flattened images."""
    if name == "digits":
        from sklearn.datasets import load_digits

        d = load_digits()
        X = torch.tensor(d.data, dtype=torch.float32) / 16.0
        y = torch.tensor(d.target)
        perm = torch.randperm(len(X), generator=torch.Generator().manual_seed(seed))
        test, train = perm[:360], perm[360:]
        return X[train], y[train], X[test], y[test]
    if name == "mnist":
        root = Path(__file__).resolve().parents[1]
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
        from experiments.data import load_dataset

        d = load_dataset("mnist")
        gen = torch.Generator().manual_seed(seed)
        idx = torch.randperm(len(d.train_y), generator=gen)[:n_train]
        flat = lambda x: x.flatten(1).float() / 255.0  # noqa: E731
        return flat(d.train_x[idx]), d.train_y[idx], flat(d.test_x[:2000]), d.test_y[:2000]
    raise ValueError(f"unknown data set {name!r}")


def make_model(n_in: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(n_in, 128), nn.Tanh(), nn.Linear(128, 10))


@torch.no_grad()
def accuracy(model, X, y) -> float:
    return (model(X).argmax(1) == y).float().mean().item()


def train(
    data,
    mode: str,
    epochs: int,
    batch_size: int,
    lr: float,
    clip: float,
    sigma: float,
    seed: int = 0,
) -> dict:
    """``mode``: "plain" (SGD), "clip" (clipping only) or "dp" (clipping + noise)."""
    X, y, Xt, yt = data
    model = curvopt.extend(make_model(X.shape[1], seed))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed + 1)
    clipped, norms = [], []
    for _ in range(epochs):
        for idx in torch.randperm(len(X), generator=gen).split(batch_size):
            if mode == "plain":
                opt.zero_grad()
                lossfunc(model(X[idx]), y[idx]).backward()
            else:
                info = dp_gradient(
                    model, lossfunc, X[idx], y[idx], clip, sigma if mode == "dp" else 0.0, gen
                )
                clipped.append(info["clipped"])
                norms.append(info["norms"].median().item())
            opt.step()
    return {
        "test_acc": accuracy(model, Xt, yt),
        "train_acc": accuracy(model, X, y),
        "clipped": sum(clipped) / len(clipped) if clipped else 0.0,
        "median_norm": sorted(norms)[len(norms) // 2] if norms else float("nan"),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", choices=["digits", "mnist"], default="digits")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--clip", type=float, default=1.0, help="clipping norm C")
    p.add_argument("--sigma", type=float, default=1.0, help="noise multiplier σ")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # small matrices: a second thread only waits (worse on a busy machine)
    data = load_data(args.dataset, seed=args.seed)
    print(
        f"{args.dataset}: {len(data[0])} training / {len(data[2])} test samples, "
        f"batch {args.batch_size}, {args.epochs} epochs, lr {args.lr}, C = {args.clip}, "
        f"σ = {args.sigma}"
    )
    print(
        f"{'training':<24} {'test acc':>8} {'train acc':>9} {'clipped':>8} "
        f"{'median ‖g_n‖':>13} {'time':>6}"
    )
    for mode, title in (
        ("plain", "plain SGD"),
        ("clip", "clipping only (σ = 0)"),
        ("dp", f"DP-SGD (σ = {args.sigma:g})"),
    ):
        t0 = time.perf_counter()
        r = train(
            data, mode, args.epochs, args.batch_size, args.lr, args.clip, args.sigma, args.seed
        )
        norm = "-" if mode == "plain" else f"{r['median_norm']:.2f}"
        clipped = "-" if mode == "plain" else f"{100 * r['clipped']:.0f}%"
        print(
            f"{title:<24} {r['test_acc']:>8.3f} {r['train_acc']:>9.3f} {clipped:>8} "
            f"{norm:>13} {time.perf_counter() - t0:>5.1f}s"
        )
    print(
        "(clipped: share of per-sample gradients with ‖g_n‖ > C, over all steps; no privacy "
        "accounting is done here)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
