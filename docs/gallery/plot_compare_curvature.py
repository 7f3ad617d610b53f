"""
Curvature approximations against the exact GGN
==============================================

``curvopt.linalg`` gives every curvature as a ``scipy`` linear operator over the parameters.
On a tiny network the matrices fit in memory: this script forms the exact GGN, its diagonal
and its KFLR and KFAC approximations, and shows the first layer's block of each with its
relative error.
"""

import matplotlib.pyplot as plt
import numpy as np
import torch
from torch import nn

import curvopt
from curvopt import linalg

torch.manual_seed(0)
X = torch.randn(64, 6)
y = torch.randint(0, 3, (64,))
model = curvopt.extend(nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)))
lossfunc = curvopt.extend(nn.CrossEntropyLoss())
data = [(X[:32], y[:32]), (X[32:], y[32:])]

operators = {
    "GGN (exact)": linalg.GGN(model, lossfunc, data),
    "diagonal": linalg.Diagonal(model, lossfunc, data, curvature="ggn_exact"),
    "KFLR": linalg.KFAC(model, lossfunc, data, curvature="kflr"),
    "KFAC (MC)": linalg.KFAC(model, lossfunc, data, curvature="kfac", seed=0),
}
P = operators["GGN (exact)"].shape[0]
dense = {name: op @ np.eye(P) for name, op in operators.items()}

# %%
# The block of the first weight (30 x 30 entries) in each matrix, all on one colour scale (that
# of the exact block, its largest entries saturated), and the relative Frobenius error of the
# whole matrix against the exact GGN.
block = slice(0, model[0].weight.numel())
exact = dense["GGN (exact)"]
bound = np.quantile(np.abs(exact[block, block]), 0.98)
fig, axes = plt.subplots(1, len(dense), figsize=(12, 3.6), layout="constrained")
for ax, (name, matrix) in zip(axes, dense.items()):
    error = np.linalg.norm(matrix - exact) / np.linalg.norm(exact)
    image = ax.imshow(matrix[block, block], cmap="RdBu_r", vmin=-bound, vmax=bound)
    ax.set_title(f"{name}\nrelative error {error:.2f}")
    ax.set_xticks([])
    ax.set_yticks([])
    print(f"{name:12s} relative error {error:.3f}")
fig.colorbar(image, ax=axes, shrink=0.9, extend="both")
plt.show()
