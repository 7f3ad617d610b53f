"""PyTorch Lightning with a curvopt optimizer swapped in: the model extended, the optimizer
returned by ``configure_optimizers``, nothing else changed; the parameters equal the plain
loop's (``dropin_loop``) in float64, for every optimizer and setting (accumulation by
``accumulate_grad_batches``, clipping by ``gradient_clip_val``, a per-step schedule,
``bf16-mixed``, ``16-mixed`` with its ``GradScaler`` (given as a plugin: Lightning replaces
``precision="16-mixed"`` on CPU by bf16), manual optimization)."""

import warnings

import pytest
import torch
from dropin_loop import (
    FUNCTIONAL_SETTINGS,
    OPTIMIZERS,
    SETTINGS,
    assert_same,
    make_loss,
    make_model,
    micro_batches,
    parameters,
    plain_loop,
    readme_snippet,
    schedule,
)
from torch.utils.data import DataLoader

pl = pytest.importorskip("pytorch_lightning")
MixedPrecision = pl.plugins.precision.MixedPrecision

PRECISION = {"64": "64-true", "bf16": "bf16-mixed"}


class _Module(pl.LightningModule):
    def __init__(self, name, setting, manual=False, functional=False):
        super().__init__()
        self.model, self.lossfunc = make_model(setting), make_loss(functional)
        self.name, self.setting = name, setting
        self.automatic_optimization = not manual

    def training_step(self, batch, batch_idx):
        X, y = batch
        loss = self.lossfunc(self.model(X), y)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return None

    def configure_optimizers(self):
        opt = OPTIMIZERS[self.name](self.model.parameters())
        if not self.setting.schedule:
            return opt
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule(opt), "interval": "step"}}


def _fit(name, setting, manual=False, functional=False):
    module = _Module(name, setting, manual, functional)
    # Lightning replaces "16-mixed" on CPU by bf16: its fp16 plugin, with a GradScaler, given
    fp16 = setting.precision == "fp16"
    precision = {} if fp16 else {"precision": PRECISION[setting.precision]}
    plugins = [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))] if fp16 else []
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        accumulate_grad_batches=len(setting.sizes),
        gradient_clip_val=setting.clip,
        plugins=plugins,
        **precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on workers, logging, precision
        trainer.fit(module, DataLoader(micro_batches(setting), batch_size=None))
    return parameters(module.model)


#: Lightning's fp16 plugin refuses gradient clipping for every optimizer that unscales the
#: gradients itself (``_step_supports_amp_scaling``, as curvopt's do): its own clear error
_REFUSED = {"fp16_clip"}


@pytest.mark.parametrize(
    "name, setting", [(n, s) for s in SETTINGS if s not in _REFUSED for n in OPTIMIZERS]
)
def test_lightning_takes_the_plain_loops_steps(name, setting):
    setting = SETTINGS[setting]
    assert_same(_fit(name, setting), plain_loop(name, setting), setting)


@pytest.mark.parametrize("name, setting", [(n, s) for s in FUNCTIONAL_SETTINGS for n in OPTIMIZERS])
def test_lightning_with_a_functional_loss_takes_the_plain_loops_steps(name, setting):
    """``training_step`` returns ``F.cross_entropy(self.model(X), y)``: no loss module at all."""
    setting = SETTINGS[setting]
    assert_same(_fit(name, setting, functional=True), plain_loop(name, setting), setting)


@pytest.mark.parametrize("name, setting", [(n, s) for s in sorted(_REFUSED) for n in OPTIMIZERS])
def test_lightning_fp16_clipping_is_refused_by_lightning(name, setting):
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        _fit(name, SETTINGS[setting])


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_lightning_manual_optimization(name):
    """``self.optimizers()`` (a ``LightningOptimizer``): ``zero_grad``, ``manual_backward``,
    ``step``, and nothing else."""
    setting = SETTINGS["one_batch"]
    assert_same(_fit(name, setting, manual=True), plain_loop(name, setting), setting)


def test_lightning_optimizer_is_wrapped_and_needs_no_collect():
    """The optimizer the Lightning module sees is Lightning's wrapper, used without
    ``collect``: only ``step``/``zero_grad`` reach the curvopt optimizer."""
    module = _Module("KFAC", SETTINGS["one_batch"], manual=True)
    seen = []
    original = module.training_step

    def training_step(batch, batch_idx):
        seen.append(isinstance(module.optimizers(), pl.core.optimizer.LightningOptimizer))
        return original(batch, batch_idx)

    module.training_step = training_step
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, DataLoader(micro_batches(SETTINGS["one_batch"]), batch_size=None))
    assert seen == [True, True]
    assert not torch.equal(parameters(module.model), parameters(make_model(SETTINGS["one_batch"])))


def test_readme_lightning_snippet_trains(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # Lightning writes its logs into the working directory
    setting = SETTINGS["accumulate_2"]
    model = make_model(setting)
    start = parameters(model)
    scope = {"pl": pl, "torch": torch, "curvopt": __import__("curvopt"), "model": model}
    scope["loader"] = DataLoader(micro_batches(setting), batch_size=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(readme_snippet("# Lightning"), scope)
    moved = parameters(model)
    assert moved.isfinite().all() and not torch.equal(moved, start)
