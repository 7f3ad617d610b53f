"""
Swapping in an optimizer: KFAC against AdamW on digits
======================================================

Swapping a curvopt optimizer in for a ``torch.optim`` one takes two lines:
``curvopt.extend(model)`` and the optimizer. The training loop stays as it is, with no
collection block: the optimizer collects the curvature it needs on every backward pass.
Here an MLP learns scikit-learn's 8x8 digits with AdamW and with KFAC, from the same start.
"""

import copy

import matplotlib.pyplot as plt
import torch
from sklearn.datasets import load_digits
from torch import nn

import curvopt

digits = load_digits()
X = torch.tensor(digits.data, dtype=torch.float32) / 16
y = torch.tensor(digits.target)
X_train, y_train, X_test, y_test = X[:1400], y[:1400], X[1400:], y[1400:]

torch.manual_seed(0)
start = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
lossfunc = curvopt.extend(nn.CrossEntropyLoss())


def train(make_optimizer, epochs=4, batch_size=64):
    """Training losses per step and the final test accuracy."""
    model = curvopt.extend(copy.deepcopy(start))  # line 1 of the swap
    opt = make_optimizer(model.parameters())  # line 2
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(epochs):
        for batch in torch.randperm(len(X_train), generator=generator).split(batch_size):
            opt.zero_grad()
            loss = lossfunc(model(X_train[batch]), y_train[batch])
            loss.backward()
            opt.step()
            losses.append(loss.item())
    accuracy = (model(X_test).argmax(1) == y_test).float().mean().item()
    return losses, accuracy


runs = {
    "AdamW, lr 3e-3": lambda ps: torch.optim.AdamW(ps, lr=3e-3),
    "KFAC, lr 0.1": lambda ps: curvopt.optim.KFAC(ps, lr=0.1, damping=1e-3),
}
results = {name: train(make) for name, make in runs.items()}
for name, (losses, accuracy) in results.items():
    print(f"{name:15s} final training loss {losses[-1]:.3f}, test accuracy {accuracy:.3f}")

# %%
# Training loss per step.
fig, ax = plt.subplots(figsize=(6, 3.5))
for name, (losses, _) in results.items():
    ax.plot(losses, label=name)
ax.set_yscale("log")
ax.set_xlabel("step (batch 64)")
ax.set_ylabel("training loss")
ax.legend()
fig.tight_layout()
plt.show()
