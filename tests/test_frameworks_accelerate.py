"""accelerate with a curvopt optimizer swapped in: ``accelerator.prepare`` wraps it in an
``AcceleratedOptimizer``, the loop is accelerate's own (``accumulate``, ``backward``,
``clip_grad_norm_``, ``step``, ``zero_grad``), with no ``collect``; the parameters equal the
plain loop's (``dropin_loop``) for every optimizer and setting (the prepared model returns
float32 outputs under autocast, so the plain loop casts them too; on CPU accelerate runs
``mixed_precision="fp16"`` with neither autocast nor a GradScaler, so the plain loop runs float32
there, ``dropin_loop.on_cpu``)."""

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
    on_cpu,
    parameters,
    plain_loop,
    readme_snippet,
    schedule,
)
from torch.utils.data import DataLoader

accelerate = pytest.importorskip("accelerate")
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

PRECISION = {"64": "no", "bf16": "bf16", "fp16": "fp16"}


def _train(name, setting, functional=False):
    AcceleratorState._reset_state(True)  # one Accelerator per test, each with its own options
    GradientState._reset_state()
    accelerator = accelerate.Accelerator(
        cpu=True,
        gradient_accumulation_steps=len(setting.sizes),
        mixed_precision=PRECISION[setting.precision],
    )
    model, lossfunc = make_model(setting), make_loss(functional)
    opt = OPTIMIZERS[name](model.parameters())
    sched = schedule(opt) if setting.schedule else None
    loader = DataLoader(micro_batches(setting), batch_size=None)
    if sched is None:
        model, opt, loader = accelerator.prepare(model, opt, loader)
    else:
        model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    assert type(opt).__name__ == "AcceleratedOptimizer"
    for X, y in loader:
        with accelerator.accumulate(model):
            with accelerator.autocast():
                loss = lossfunc(model(X), y)
            accelerator.backward(loss)
            if setting.clip is not None and accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), setting.clip)
            opt.step()
            if sched is not None:
                sched.step()
            opt.zero_grad()
    return parameters(accelerator.unwrap_model(model))


def _cases():
    for setting in SETTINGS:
        for name in OPTIMIZERS:
            yield pytest.param(name, setting, False, id=f"{name}-{setting}")
    for setting in FUNCTIONAL_SETTINGS:  # F.cross_entropy(model(X), y): no loss module
        for name in OPTIMIZERS:
            yield pytest.param(name, setting, True, id=f"{name}-{setting}-functional")


@pytest.mark.parametrize("name, setting, functional", list(_cases()))
def test_accelerate_takes_the_plain_loops_steps(name, setting, functional):
    setting = SETTINGS[setting]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # accelerate's notes on CPU mixed precision
        got = _train(name, setting, functional)
    assert_same(got, plain_loop(name, on_cpu(setting), float_outputs=True), setting)


def test_readme_accelerate_snippet_trains():
    """(KFAC's Monte-Carlo targets: accelerate's data loader draws from the global generator
    too, so the steps are compared for the deterministic curvatures above only.)"""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    setting = SETTINGS["accumulate_2"]
    model = make_model(setting)
    start = parameters(model)
    scope = {"Accelerator": accelerate.Accelerator, "curvopt": __import__("curvopt")}
    scope.update(model=model, lossfunc=make_loss())
    scope["loader"] = DataLoader(micro_batches(setting), batch_size=None)
    exec(readme_snippet("# accelerate"), scope)
    moved = parameters(model)
    assert moved.isfinite().all() and not torch.equal(moved, start)
