"""Per-sample gradient norms on scikit-learn's 8x8 digits: which training examples are hardest?

Trains a small CNN for a few epochs. After every epoch it prints the epoch's mean training loss
and, per layer, the signal-to-noise ratio of a mini-batch gradient, estimated on a fixed probe
batch by one backward pass with ``Variance``. After training one pass per chunk yields every
example's gradient norm (``BatchL2Grad``); the examples with the largest norms are printed
(often mislabelled or ambiguous digits).

Scaling (docs/conventions.md): with ``reduction="mean"`` over ``N`` samples, the per-sample
quantities are those of ``g_n / N``, ``g_n`` the gradient of sample ``n``'s own loss. Hence the
factors ``N`` and ``N**2`` below; with ``reduction="sum"`` they are 1.
"""

import time

import torch
from sklearn.datasets import load_digits
from torch import nn

import curvopt
from curvopt import extensions as ext


def _scale(lossfunc: nn.Module, n: int) -> int:
    """``N`` for a mean-reduced loss over ``n`` samples (rows are ``g_n / N``), else 1."""
    return n if lossfunc.reduction == "mean" else 1


def gradient_snr(model, lossfunc, X, y, batch_size: int) -> dict[str, float]:
    """Per parameter: ``|E g|^2 / (tr Cov(g) / batch_size)``, the signal-to-noise ratio of a
    mini-batch gradient of ``batch_size`` samples, with the mean and covariance of the
    per-sample gradients ``g_n`` estimated on the probe batch ``(X, y)``."""
    model.zero_grad()
    with curvopt.collect(ext.Variance()):
        lossfunc(model(X), y).backward()
    s = _scale(lossfunc, len(X))
    out = {}
    for name, p in model.named_parameters():
        mean_g = p.grad * s / len(X)  # p.grad = sum_n g_n / s
        cov_trace = p.variance.sum() * s**2  # variance is that of the rows g_n / s
        out[name] = (mean_g.pow(2).sum() / (cov_trace / batch_size)).item()
    model.zero_grad()
    return out


def sample_grad_norms(model, lossfunc, X, y, chunk: int = 256) -> torch.Tensor:
    """``|g_n|`` of every sample (all parameters), one backward pass per chunk."""
    norms = torch.zeros(len(X), dtype=X.dtype)
    for idx in torch.arange(len(X)).split(chunk):
        model.zero_grad()
        with curvopt.collect(ext.BatchL2Grad()):
            lossfunc(model(X[idx]), y[idx]).backward()
        squared = sum(p.batch_l2 for p in model.parameters())  # of the rows g_n / s
        norms[idx] = (squared * _scale(lossfunc, len(idx)) ** 2).sqrt()
    model.zero_grad()
    return norms


def main(epochs: int = 8, batch_size: int = 64, seed: int = 0, probe: int = 512) -> None:
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
    probe_idx = torch.randperm(len(X))[:probe]  # the same probe batch after every epoch
    start = time.perf_counter()
    for epoch in range(epochs):
        loss_sum = 0.0
        for idx in torch.randperm(len(X)).split(batch_size):
            opt.zero_grad()
            loss = lossfunc(model(X[idx]), y[idx])
            loss.backward()
            opt.step()
            loss_sum += loss.item() * len(idx)
        snr = gradient_snr(model, lossfunc, X[probe_idx], y[probe_idx], batch_size)
        acc = (model(X).argmax(1) == y).float().mean().item()
        print(
            f"epoch {epoch}: mean train loss {loss_sum / len(X):.3f}  train acc {acc:.3f}  "
            f"SNR of a {batch_size}-sample gradient "
            + " ".join(f"{k}={v:.2g}" for k, v in snr.items())
        )
    norms = sample_grad_norms(model, lossfunc, X, y)
    hardest = norms.argsort(descending=True)[:10]
    pred = model(X[hardest]).argmax(1)
    print(f"\n{len(X)} digits, {time.perf_counter() - start:.1f}s. Hardest examples:")
    print(" index  label  predicted  grad-norm")
    for i, p in zip(hardest.tolist(), pred.tolist()):
        print(f" {i:5d}  {y[i].item():5d}  {p:9d}  {norms[i].item():9.3f}")


if __name__ == "__main__":
    main()
