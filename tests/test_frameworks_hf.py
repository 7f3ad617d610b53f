"""The Hugging Face ``Trainer`` with a curvopt optimizer swapped in
(``optimizers=(opt, scheduler)``), nothing else changed: the parameters equal the plain
loop's (``dropin_loop``) for every optimizer and setting (``gradient_accumulation_steps``,
``max_grad_norm``, a schedule, ``bf16``; ``fp16`` runs as float32 on CPU, as accelerate runs it,
``dropin_loop.on_cpu``), and a tiny GPT-2's own ``labels=`` loss."""

import warnings

import pytest
import torch
from dropin_loop import (
    OPTIMIZERS,
    SETTINGS,
    Setting,
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
from torch import nn


transformers = pytest.importorskip("transformers")

#: the Trainer batches consecutive samples with one batch size: the unequal micro-batches
#: of one step (5 + 3) are one epoch of 8 samples
HF_SETTINGS = {**SETTINGS, "accumulate_2_unequal": Setting((5, 3), steps=1)}


class _WithLoss(nn.Module):
    """A model that computes its loss from ``labels=``, as Hugging Face models do (here with
    the extended loss module)."""

    def __init__(self, setting):
        super().__init__()
        self.model, self.lossfunc = make_model(setting), make_loss()

    def forward(self, x, labels):
        logits = self.model(x)
        return {"loss": self.lossfunc(logits, labels), "logits": logits}


def _arguments(setting, directory, batch):
    return transformers.TrainingArguments(
        output_dir=str(directory),
        use_cpu=True,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=len(setting.sizes),
        max_grad_norm=setting.clip or 0.0,
        num_train_epochs=1,
        bf16=setting.precision == "bf16",
        fp16=setting.precision == "fp16",
        train_sampling_strategy="sequential",
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def _constant(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)


def _train(name, setting, directory):
    module = _WithLoss(setting)
    opt = OPTIMIZERS[name](module.parameters())
    sched = schedule(opt) if setting.schedule else _constant(opt)
    data = [{"x": x, "labels": label} for X, y in micro_batches(setting) for x, label in zip(X, y)]
    trainer = transformers.Trainer(
        model=module,
        args=_arguments(setting, directory, setting.sizes[0]),
        train_dataset=data,
        optimizers=(opt, sched),
    )
    trainer.train()
    return parameters(module.model)


def _cases():
    for setting in HF_SETTINGS:
        for name in OPTIMIZERS:
            yield pytest.param(name, setting, id=f"{name}-{setting}")


@pytest.mark.parametrize("name, setting", list(_cases()))
def test_trainer_takes_the_plain_loops_steps(name, setting, tmp_path):
    setting = HF_SETTINGS[setting]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the Trainer's notes on plain nn.Module models
        got = _train(name, setting, tmp_path)
    assert_same(got, plain_loop(name, on_cpu(setting)), setting)


# ------------------------------------------------------------------ a model's own labels= loss
def _gpt2():
    config = transformers.GPT2Config(
        vocab_size=11,
        n_positions=6,
        n_embd=8,
        n_layer=1,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).to(torch.float64)


def _tokens():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 11, (8, 5), generator=g)


def _gpt2_plain(name):
    import curvopt

    model = curvopt.extend(_gpt2())
    opt = OPTIMIZERS[name](model.parameters())
    tokens = _tokens()
    for part in (slice(0, 4), slice(4, 8)):
        opt.zero_grad()
        # the Trainer's normalisation: the sum of the shifted token losses over the count of
        # all labels (transformers 5.24 counts position 0 for GPT-2 too)
        count = torch.tensor(tokens[part].numel())
        out = model(input_ids=tokens[part], labels=tokens[part], num_items_in_batch=count)
        out.loss.backward()
        opt.step()
    return parameters(model)


def _gpt2_trainer(name, directory):
    import curvopt

    model = curvopt.extend(_gpt2())
    opt = OPTIMIZERS[name](model.parameters())
    data = [{"input_ids": t, "labels": t} for t in _tokens()]
    args = _arguments(SETTINGS["one_batch"], directory, 4)
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=data, optimizers=(opt, _constant(opt))
    )
    trainer.train()
    return parameters(model)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_trainer_with_the_models_own_loss(name, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = _gpt2_trainer(name, tmp_path)
    want = _gpt2_plain(name)
    scale = want.abs().max()
    assert float((got - want).abs().max() / scale) <= 1e-12
    assert not torch.equal(want, parameters(_gpt2()))


def test_readme_trainer_snippet_trains(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # TrainingArguments("out")
    setting = SETTINGS["accumulate_2"]
    module = _WithLoss(setting)
    start = parameters(module.model)
    data = [{"x": x, "labels": label} for X, y in micro_batches(setting) for x, label in zip(X, y)]
    scope = {"curvopt": __import__("curvopt"), "model": module, "dataset": data}
    scope.update(Trainer=transformers.Trainer, TrainingArguments=transformers.TrainingArguments)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(readme_snippet("# the Hugging Face Trainer"), scope)
    moved = parameters(module.model)
    assert moved.isfinite().all() and not torch.equal(moved, start)


def _lm_loss(lossfunc, logits, labels, count):
    """The causal LM loss from an extended ``CrossEntropyLoss(reduction="sum")``, divided by
    ``count`` (the Trainer's ``num_items_in_batch``)."""
    return lossfunc(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()) / count


def _gpt2_plain_extended_loss(name):
    import curvopt

    model = curvopt.extend(_gpt2())
    lossfunc = curvopt.extend(nn.CrossEntropyLoss(reduction="sum"))
    opt = OPTIMIZERS[name](model.parameters())
    tokens = _tokens()
    for part in (slice(0, 4), slice(4, 8)):
        opt.zero_grad()
        logits = model(input_ids=tokens[part]).logits
        count = tokens[part].numel()  # the Trainer's num_items_in_batch (see above)
        _lm_loss(lossfunc, logits, tokens[part], count).backward()
        opt.step()
    return parameters(model)


#: the losses ``compute_loss_func`` computes the causal LM loss with
LOSSES = {
    "extended": lambda: __import__("curvopt").extend(nn.CrossEntropyLoss(reduction="sum")),
    "functional": lambda: lambda z, y: nn.functional.cross_entropy(z, y, reduction="sum"),
}


@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_trainer_with_compute_loss_func(name, loss, tmp_path):
    """Second order for a Hugging Face model in the Trainer: ``compute_loss_func`` computes
    the loss from the logits with an extended loss module or with ``F.cross_entropy`` (the
    Trainer then passes no ``labels=`` to the model)."""
    import curvopt

    model = curvopt.extend(_gpt2())
    lossfunc = LOSSES[loss]()
    opt = OPTIMIZERS[name](model.parameters())
    data = [{"input_ids": t, "labels": t} for t in _tokens()]

    def compute_loss_func(outputs, labels, num_items_in_batch):
        return _lm_loss(lossfunc, outputs.logits, labels, num_items_in_batch)

    trainer = transformers.Trainer(
        model=model,
        args=_arguments(SETTINGS["one_batch"], tmp_path, 4),
        train_dataset=data,
        optimizers=(opt, _constant(opt)),
        compute_loss_func=compute_loss_func,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    want = _gpt2_plain_extended_loss(name)
    scale = want.abs().max()
    assert float((parameters(model) - want).abs().max() / scale) <= 1e-12
    assert not torch.equal(want, parameters(_gpt2()))


def test_trainer_evaluates_schedule_free_kfac_at_its_average(tmp_path):
    """With evaluations during training the Trainer calls ``opt.eval()`` before each and
    ``opt.train()`` before each step: the evaluations see schedule-free's average ``x`` and
    the training continues from ``y``, as in a loop that makes the same calls."""
    setting = SETTINGS["one_batch"]
    name = "KFAC-schedule-free"
    seen = []

    class Record(transformers.TrainerCallback):
        def on_evaluate(self, args, state, control, model=None, **kwargs):
            seen.append(parameters(model.model))

    module = _WithLoss(setting)
    opt = OPTIMIZERS[name](module.parameters())
    data = [{"x": x, "labels": label} for X, y in micro_batches(setting) for x, label in zip(X, y)]
    args = _arguments(setting, tmp_path, setting.sizes[0])
    args.eval_strategy, args.eval_steps, args.per_device_eval_batch_size = "steps", 1, 8
    trainer = transformers.Trainer(
        model=module,
        args=args,
        train_dataset=data,
        eval_dataset=data[:8],
        optimizers=(opt, _constant(opt)),
        callbacks=[Record()],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    model, lossfunc = make_model(setting), make_loss()
    ref = OPTIMIZERS[name](model.parameters())
    averages = []
    for X, y in micro_batches(setting):
        ref.train()
        ref.zero_grad()
        lossfunc(model(X), y).backward()
        ref.step()
        ref.eval()
        averages.append(parameters(model))
    assert len(seen) == len(averages) == setting.steps
    for got, want in zip(seen, averages):
        assert_same(got, want, setting)
    ref.train()
    assert not torch.allclose(parameters(model), averages[-1])  # x and y differ
