"""
The Kronecker factors of a layer
================================

KFLR approximates the GGN block of a linear layer's weight ``W`` (``[out, in]``) by
``B ⊗ A``: ``A = E[a aᵀ]`` (``[in, in]``) from the layer's inputs, ``B`` (``[out, out]``) from
the loss's curvature propagated back to its outputs. One backward pass with ``KFLR()`` writes
``W.kflr = [B, A]``; ``torch.kron(B, A)`` is indexed like ``W.flatten()``. The figure draws
both factors, their product and the exact GGN block from ``curvopt.linalg.GGN``.
"""

import matplotlib.pyplot as plt
import numpy as np
import torch
from torch import nn

import curvopt
from curvopt import extensions as ext
from curvopt import linalg

torch.manual_seed(0)
X, y = torch.randn(256, 5), torch.randint(0, 4, (256,))
model = curvopt.extend(nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 4)))
lossfunc = curvopt.extend(nn.CrossEntropyLoss())

with curvopt.collect(ext.KFLR()):
    lossfunc(model(X), y).backward()
W = model[0].weight  # [6, 5]
B, A = W.kflr  # [6, 6], [5, 5]
kron = torch.kron(B, A).numpy()

G = linalg.GGN(model, lossfunc, [(X, y)])
block = (G @ np.eye(G.shape[0]))[: W.numel(), : W.numel()]  # W's block of the exact GGN
error = np.linalg.norm(kron - block) / np.linalg.norm(block)
print(f"B {tuple(B.shape)}, A {tuple(A.shape)}, relative error of B ⊗ A: {error:.3f}")
# the input side is the layer's input second moment, here that of the data
print("largest difference of A to Xᵀ X / N:", float((A - X.T @ X / len(X)).abs().max()))

# %%
# Each matrix on its own colour scale (symmetric around 0).
panels = {
    "B (outputs)": B.numpy(),
    "A (inputs)": A.numpy(),
    "B ⊗ A": kron,
    "exact GGN block": block,
}
fig, axes = plt.subplots(1, 4, figsize=(12, 3.4))
for ax, (title, matrix) in zip(axes, panels.items()):
    bound = np.abs(matrix).max()
    image = ax.imshow(matrix, cmap="RdBu_r", vmin=-bound, vmax=bound)
    ax.set_title(f"{title}\n{matrix.shape[0]} x {matrix.shape[1]}")
    ax.set_xticks([])
    ax.set_yticks([])
    fig.colorbar(image, ax=ax, shrink=0.8)
fig.tight_layout()
plt.show()
