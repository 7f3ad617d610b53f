"""
Per-sample gradient norms
=========================

One backward pass with ``BatchL2Grad`` gives every sample's gradient norm. Under
``reduction="mean"`` each row carries the loss's ``1/N``, so the norms of the samples' own
gradients are ``N`` times the square root of the summed ``batch_l2``. This script checks them
against ``torch.func`` and plots their distribution on a small classifier.
"""

import matplotlib.pyplot as plt
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import curvopt
from curvopt import extensions as ext

torch.manual_seed(0)
N = 256
X = torch.randn(N, 20)
y = (X[:, :3].sum(1) > 0).long() + (X[:, 3] > 1).long()
model = curvopt.extend(nn.Sequential(nn.Linear(20, 32), nn.Tanh(), nn.Linear(32, 3)))
lossfunc = curvopt.extend(nn.CrossEntropyLoss())

with curvopt.collect(ext.BatchL2Grad()):
    lossfunc(model(X), y).backward()
norms = N * sum(p.batch_l2 for p in model.parameters()).sqrt()

# %%
# The same norms from ``torch.func``: the gradient of each sample's own loss.
params = {k: v.detach() for k, v in model.named_parameters()}


def sample_loss(params, x, t):
    out = functional_call(model, params, (x[None],))
    return nn.functional.cross_entropy(out, t[None])


per_sample = vmap(grad(sample_loss), in_dims=(None, 0, 0))(params, X, y)
reference = sum(g.flatten(1).pow(2).sum(1) for g in per_sample.values()).sqrt()
print("largest relative difference:", float(((norms - reference).abs() / reference).max()))

# %%
# The distribution of the norms: the few large ones are the samples the model fits worst.
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.hist(norms.numpy(), bins=40)
ax.set_xlabel(r"$\|\nabla \ell_n\|$")
ax.set_ylabel("samples")
ax.set_title("per-sample gradient norms, one backward pass")
fig.tight_layout()
plt.show()
