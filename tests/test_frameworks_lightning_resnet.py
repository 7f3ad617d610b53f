"""PyTorch Lightning trains a ResNet with ``BatchNorm2d`` in training mode when
``configure_optimizers`` returns ``curvopt.optim.KFAC(self.parameters(), lr=...)`` (issue 51,
item 9): the model extended once, nothing else changed. The model is in training mode as built
(Lightning 2.6 keeps each submodule's mode); the BatchNorm layers normalise with batch
statistics and update their running statistics on every step, and the loss falls (measured: the
last pass over the four batches at 0.32 of the first, float32, seed 0)."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from test_models_people_train import BATCHES, batches, resnet
from torch import nn
from torch.utils.data import DataLoader

import curvopt

pl = pytest.importorskip("pytorch_lightning")

STEPS = 30


class ResNetModule(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = curvopt.extend(resnet())
        self.losses, self.modes = [], []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.modes.append(
            [m.training for m in self.model.modules() if isinstance(m, nn.BatchNorm2d)]
        )
        loss = F.cross_entropy(self.model(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return curvopt.optim.KFAC(self.parameters(), lr=0.1)


def test_lightning_trains_a_resnet_with_batchnorm_in_training_mode():
    torch.manual_seed(0)
    module = ResNetModule()
    assert module.training  # as built; Lightning (>= 2.2) keeps each submodule's own mode
    data = [(x, y) for (x,), y in batches("resnet", torch.Generator().manual_seed(0))]
    trainer = pl.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on workers; the fallback's notice
        trainer.fit(module, DataLoader(data, batch_size=None))

    losses = module.losses
    assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses)))
    first, last = sum(losses[:BATCHES]) / BATCHES, sum(losses[-BATCHES:]) / BATCHES
    assert last < 0.6 * first, losses
    assert module.modes and all(all(step) and len(step) == 5 for step in module.modes)
    for bn in (m for m in module.model.modules() if isinstance(m, nn.BatchNorm2d)):
        assert bn.num_batches_tracked.item() == STEPS  # batch statistics on every step
        assert not torch.equal(bn.running_mean, torch.zeros_like(bn.running_mean))
        assert not torch.equal(bn.running_var, torch.ones_like(bn.running_var))
    assert isinstance(trainer.optimizers[0], curvopt.optim.KFAC)
