"""
A curvopt optimizer inside Lightning
====================================

A LightningModule returns the curvopt optimizer from ``configure_optimizers``, as it would a
``torch.optim`` one; the model is extended once, in ``__init__``. Lightning's loop (with
gradient accumulation and clipping here) runs the backward passes, and the optimizer collects
its curvature on each of them on its own.
"""

import logging
import warnings

import matplotlib.pyplot as plt
import pytorch_lightning as pl
import torch
from torch import nn

import curvopt

# Lightning's hints about data-loader workers and loggers do not concern the example.
logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
warnings.filterwarnings("ignore", module="pytorch_lightning")


class Classifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = curvopt.extend(nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 3)))
        self.losses = []

    def training_step(self, batch, batch_idx):
        X, y = batch
        loss = nn.functional.cross_entropy(self.model(X), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return curvopt.optim.KFAC(self.parameters(), lr=0.1, damping=1e-3)


torch.manual_seed(0)
X = torch.randn(1024, 8)
y = (X[:, 0] > 0).long() + (X[:, 1] > 0.5).long()
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, y), batch_size=64,
                                     shuffle=True)  # fmt: skip
module = Classifier()
trainer = pl.Trainer(
    max_epochs=3, accumulate_grad_batches=2, gradient_clip_val=1.0, logger=False,
    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
)  # fmt: skip
trainer.fit(module, loader)
print(f"{trainer.global_step} optimizer steps, final loss {module.losses[-1]:.3f}")

# %%
# The loss of every micro-batch (two per optimizer step).
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(module.losses)
ax.set_xlabel("micro-batch (batch 64, two per step)")
ax.set_ylabel("training loss")
fig.tight_layout()
plt.show()
