"""
The gradient noise scale along training
=======================================

The simple noise scale ``B_simple = tr(Σ) / |G|²`` (McCandlish et al., 2018) compares the
variance of the per-sample gradients with the squared true gradient: batches much larger than
it gain little per step. ``Variance()`` gives, per parameter, the element-wise variance of the
rows of ``grad_batch`` in one backward pass. Under ``reduction="mean"`` the rows are
``g_n / N``, so ``tr Σ = N³/(N-1) · Σ p.variance`` (unbiased), and
``|G|² ≈ |ḡ|² - tr Σ / N`` removes the noise from the batch gradient's squared norm.
"""

import matplotlib.pyplot as plt
import torch
from torch import nn

import curvopt
from curvopt import extensions as ext

torch.manual_seed(0)
X = torch.randn(2048, 20)
y = (X[:, :5].sum(1) + 0.5 * torch.randn(2048) > 0).long()
model = curvopt.extend(nn.Sequential(nn.Linear(20, 32), nn.Tanh(), nn.Linear(32, 2)))
lossfunc = curvopt.extend(nn.CrossEntropyLoss())
params = list(model.parameters())
opt = torch.optim.SGD(params, lr=0.1)


def noise_scale(N):
    """``(tr Σ, |G|², B_simple)`` of the last backward pass, on a batch of ``N`` samples."""
    tr_sigma = N**3 / (N - 1) * sum(p.variance.sum() for p in params)
    grad_sq = sum(p.grad.pow(2).sum() for p in params) - tr_sigma / N
    return float(tr_sigma), float(grad_sq), float(tr_sigma / grad_sq)


# %%
# The terms of the first batch against the per-sample gradients of a loop.
N = 128
with curvopt.collect(ext.Variance()):
    lossfunc(model(X[:N]), y[:N]).backward()
tr_sigma, grad_sq, b_simple = noise_scale(N)
per_sample = torch.stack([
    torch.cat([g.flatten() for g in torch.autograd.grad(
        nn.functional.cross_entropy(model(x[None]), t[None]), params)])
    for x, t in zip(X[:N], y[:N])
])  # fmt: skip
loop = per_sample.var(0, unbiased=True).sum()
print(f"tr Σ: {tr_sigma:.5f} from Variance, {float(loop):.5f} from the loop")
print(f"B_simple at the start: {b_simple:.1f}")

# %%
# Along training, the ratio of the terms averaged over windows of 10 steps (one batch's
# estimate of ``|G|²`` is noisy, and can be negative where the gradient is small): the noise
# scale grows as the gradient shrinks, so later in training larger batches pay off.
steps, scales, window = [], [], []
generator = torch.Generator().manual_seed(1)
for step in range(1, 101):
    batch = torch.randint(0, len(X), (N,), generator=generator)
    opt.zero_grad()
    with curvopt.collect(ext.Variance()):
        lossfunc(model(X[batch]), y[batch]).backward()
    window.append(noise_scale(N)[:2])
    opt.step()
    if step % 10 == 0:
        tr_sigma, grad_sq = (sum(terms) / len(window) for terms in zip(*window))
        steps.append(step)
        scales.append(tr_sigma / grad_sq)
        window = []

fig, ax = plt.subplots(figsize=(6, 3.5), layout="constrained")
ax.plot(steps, scales, marker=".")
ax.set_yscale("log")
ax.set_xlabel("SGD step")
ax.set_ylabel(r"$B_\mathrm{simple}$, 10-step windows")
plt.show()
