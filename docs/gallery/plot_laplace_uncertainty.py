"""
Laplace predictive uncertainty
==============================

A Laplace approximation turns a trained network into a Gaussian posterior over its weights,
``N(θ_MAP, (GGN + prior precision)^-1)``; its predictive is less confident away from the data,
where the MAP network stays sure of itself. ``curvopt.laplace.CurvoptGGN`` is a backend of
laplace-torch: here the Kronecker-factored GGN of a small classifier of two interleaved half
moons, the prior precision fitted by the marginal likelihood.
"""

import warnings

import matplotlib.pyplot as plt
import numpy as np
import torch
from laplace import Laplace
from sklearn.datasets import make_moons
from torch import nn

from curvopt.laplace import CurvoptGGN

torch.manual_seed(0)
points, labels = make_moons(n_samples=200, noise=0.15, random_state=0)
X, y = torch.tensor(points, dtype=torch.float32), torch.tensor(labels)
model = nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 2))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
for _ in range(400):
    opt.zero_grad()
    nn.functional.cross_entropy(model(X), y).backward()
    opt.step()

loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, y), batch_size=50)
la = Laplace(model, "classification", subset_of_weights="all", hessian_structure="kron",
             backend=CurvoptGGN)  # fmt: skip
la.fit(loader)
with warnings.catch_warnings():  # laplace-torch reminds every classifier of its link_approx
    warnings.simplefilter("ignore", UserWarning)
    la.optimize_prior_precision(method="marglik", pred_type="glm", link_approx="probit")
print(f"prior precision fitted by the marginal likelihood: {float(la.prior_precision):.3f}")

# %%
# The confidence (the largest class probability) of the MAP network and of the Laplace
# predictive (GLM, probit) on a grid around the data.
xx, yy = np.meshgrid(np.linspace(-2.5, 3.5, 120), np.linspace(-2.0, 2.5, 100))
grid = torch.tensor(np.stack([xx.ravel(), yy.ravel()], 1), dtype=torch.float32)
with torch.no_grad():
    map_confidence = model(grid).softmax(1).max(1).values.numpy()
laplace_confidence = la(grid, pred_type="glm", link_approx="probit").max(1).values.numpy()

fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
for ax, (title, confidence) in zip(
    axes, {"MAP": map_confidence, "Laplace (KFAC GGN)": laplace_confidence}.items()
):
    image = ax.contourf(xx, yy, confidence.reshape(xx.shape), levels=np.linspace(0.5, 1, 11),
                        cmap="viridis")  # fmt: skip
    ax.scatter(points[:, 0], points[:, 1], c=labels, cmap="coolwarm", s=8, edgecolors="k",
               linewidths=0.3)  # fmt: skip
    ax.set_title(f"{title}: confidence")
fig.colorbar(image, ax=axes, shrink=0.9)
plt.show()
