"""Curvature optimizers against SGD on scikit-learn's 8x8 digits.

Trains the same small MLP with ``torch.optim.SGD`` and each optimizer of ``curvopt.optim`` for a
few epochs and prints the training loss, accuracy and wall time of each. Every curvopt optimizer
is a drop-in replacement: the same ``opt.step(closure)`` loop drives all of them (equivalently:
``with opt.collect(): loss.backward()`` followed by ``opt.step()``).
"""

import time

import torch
from sklearn.datasets import load_digits
from torch import nn

import curvopt
from curvopt.optim import KFAC, DiagGGNNewton, LevenbergMarquardt, VarianceAdaptedSGD

OPTIMIZERS = {
    "SGD": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "VarianceAdaptedSGD": lambda ps: VarianceAdaptedSGD(ps, lr=0.3, momentum=0.9),
    "DiagGGNNewton (exact)": lambda ps: DiagGGNNewton(
        ps, lr=0.5, damping=1.0, curvature="exact", momentum=0.5
    ),
    "KFAC (kfac)": lambda ps: KFAC(ps, lr=0.1, damping=1e-2, curvature="kfac", momentum=0.5),
    "KFAC (kflr, LM damping, every 5 steps)": lambda ps: KFAC(
        ps,
        lr=0.3,
        damping=LevenbergMarquardt(1e-1),
        curvature="kflr",
        curvature_interval=5,
        curvature_ema=0.9,
        kl_clip=1e-2,
    ),
}


def train(name, make, X, y, epochs, batch_size, seed):
    torch.manual_seed(seed)
    model = curvopt.extend(nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10)))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    opt = make(model.parameters())
    start = time.perf_counter()
    for _ in range(epochs):
        for idx in torch.randperm(len(X)).split(batch_size):

            def closure(idx=idx):
                opt.zero_grad()
                loss = lossfunc(model(X[idx]), y[idx])
                loss.backward()
                return loss

            opt.step(closure)  # curvopt optimizers run the closure inside opt.collect()
    seconds = time.perf_counter() - start
    with torch.no_grad():
        logits = model(X)
        loss = nn.functional.cross_entropy(logits, y).item()
        acc = (logits.argmax(1) == y).float().mean().item()
    print(f"{name:40s} loss {loss:.3f}  acc {acc:.3f}  {seconds:5.1f}s")


def main(epochs: int = 3, batch_size: int = 64, seed: int = 0) -> None:
    torch.set_num_threads(2)
    digits = load_digits()
    X = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    print(f"{len(X)} digits, {epochs} epochs, batch size {batch_size}")
    for name, make in OPTIMIZERS.items():
        train(name, make, X, y, epochs, batch_size, seed)


if __name__ == "__main__":
    main()
