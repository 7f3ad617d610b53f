"""Per-sample gradient norms on scikit-learn's 8x8 digits: which training examples are hardest?

Trains a small CNN for a few epochs; in every step one backward pass also yields each sample's
gradient norm (``BatchL2Grad``) and the gradient variance (``Variance``). Prints the examples with
the largest gradient norm after training (often mislabelled or ambiguous digits) and the
signal-to-noise ratio of the gradient per layer.
"""

import time

import torch
from sklearn.datasets import load_digits
from torch import nn

import curvopt
from curvopt import extensions as ext


def main(epochs: int = 8, batch_size: int = 64, seed: int = 0) -> None:
    torch.manual_seed(seed)
    torch.set_num_threads(2)
    digits = load_digits()
    X = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    model = curvopt.extend(
        nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1, stride=2),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(32 * 4 * 4, 10),
        )
    )
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    start = time.perf_counter()
    for epoch in range(epochs):
        order = torch.randperm(len(X))
        for idx in order.split(batch_size):
            opt.zero_grad()
            loss = lossfunc(model(X[idx]), y[idx])
            with curvopt.collect(ext.Variance()):
                loss.backward()
            opt.step()
        snr = {
            name: (p.grad.pow(2).sum() / p.variance.sum()).item()
            for name, p in model.named_parameters()
        }
        acc = (model(X).argmax(1) == y).float().mean().item()
        print(
            f"epoch {epoch}: loss {loss.item():.3f}  train acc {acc:.3f}  "
            "grad SNR per layer " + " ".join(f"{k}={v:.2g}" for k, v in snr.items())
        )
    # per-sample gradient norms of every training example (sum over layers)
    norms = torch.zeros(len(X))
    for idx in torch.arange(len(X)).split(256):
        model.zero_grad()
        loss = lossfunc(model(X[idx]), y[idx])
        with curvopt.collect(ext.BatchL2Grad()):
            loss.backward()
        norms[idx] = sum(p.batch_l2 for p in model.parameters()) * len(idx) ** 2
    hardest = norms.argsort(descending=True)[:10]
    pred = model(X[hardest]).argmax(1)
    print(f"\n{len(X)} digits, {time.perf_counter() - start:.1f}s. Hardest examples:")
    print(" index  label  predicted  grad-norm")
    for i, p in zip(hardest.tolist(), pred.tolist()):
        print(f" {i:5d}  {y[i].item():5d}  {p:9d}  {norms[i].sqrt().item():9.3f}")


if __name__ == "__main__":
    main()
