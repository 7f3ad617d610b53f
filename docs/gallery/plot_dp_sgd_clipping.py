"""
DP-SGD: clipping every sample's gradient
========================================

DP-SGD (Abadi et al., 2016) clips each sample's gradient ``g_n`` to the norm ``C`` and adds
Gaussian noise before averaging:
``g̃ = (Σ_n g_n · min(1, C / ‖g_n‖) + N(0, σ² C² I)) / N``.
One backward pass with ``BatchGrad`` and ``BatchL2Grad`` gives the ``g_n`` and their norms.
Under ``reduction="mean"`` the rows of ``grad_batch`` are ``g_n / N``: they are scaled by ``N``.
"""

import matplotlib.pyplot as plt
import torch
from torch import nn

import curvopt
from curvopt import extensions as ext

torch.manual_seed(0)
N, C, sigma = 128, 2.0, 0.5
X = torch.randn(N, 10)
y = (X[:, 0] + 0.5 * X[:, 1] > 0).long()
model = curvopt.extend(nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 2)))
lossfunc = curvopt.extend(nn.CrossEntropyLoss())
params = list(model.parameters())


def dp_gradient(X, y, generator):
    """The DP-SGD gradient written into ``p.grad``; returns the per-sample norms."""
    model.zero_grad()
    with curvopt.collect(ext.BatchGrad(), ext.BatchL2Grad()):
        lossfunc(model(X), y).backward()
    n = len(X)
    norms = n * sum(p.batch_l2 for p in params).sqrt()  # ‖g_n‖, [N]
    factor = (C / (norms + 1e-6)).clamp(max=1.0)  # min(1, C / ‖g_n‖)
    for p in params:
        clipped = torch.einsum("n,n...->...", factor, n * p.grad_batch)
        noise = sigma * C * torch.randn(p.shape, generator=generator)
        p.grad = (clipped + noise) / n
    return norms


# %%
# The norms from one pass against a loop over samples, each through its own backward pass.
norms = dp_gradient(X, y, torch.Generator().manual_seed(1))
loop = []
for x_n, y_n in zip(X, y):
    grads = torch.autograd.grad(nn.functional.cross_entropy(model(x_n[None]), y_n[None]), params)
    loop.append(torch.sqrt(sum(g.pow(2).sum() for g in grads)))
print("largest difference to the loop:", float((norms - torch.stack(loop)).abs().max()))

# %%
# Training with the clipped, noisy gradient, and the norms before and after clipping.
opt = torch.optim.SGD(model.parameters(), lr=0.5)
generator = torch.Generator().manual_seed(2)
first = norms.detach().clone()
losses = []
for _ in range(60):
    batch = torch.randint(0, N, (32,), generator=generator)
    dp_gradient(X[batch], y[batch], generator)
    opt.step()
    with torch.no_grad():
        losses.append(float(nn.functional.cross_entropy(model(X), y)))

fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5), layout="constrained")
ranked = first.sort().values
left.plot(ranked.numpy(), label=r"$\|g_n\|$")
left.plot(ranked.clamp(max=C).numpy(), label=r"after clipping to $C$")
left.set_xlabel("sample, by its gradient norm")
left.set_ylabel("gradient norm at the start")
left.legend()
right.plot(losses)
right.set_xlabel("DP-SGD step (batch 32)")
right.set_ylabel("training loss")
plt.show()
