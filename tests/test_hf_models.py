"""Tiny Hugging Face models built from configs (random init, no download), float64.

Skipped without ``transformers``; every pattern is reproduced in plain torch in
``test_hf_patterns.py``, ``test_conv1d.py`` and ``test_recurrent.py``. References:
``curvopt.verify`` (per-sample re-runs through ``torch.func``) with the models' keyword
inputs and ``.logits``.
"""

from __future__ import annotations

import pathlib
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import curvopt
from curvopt import extensions as ext

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

DT = torch.float64
V = 29


def gpt2():
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=16,
        n_head=2,
        vocab_size=V,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)


def bert():
    config = transformers.BertConfig(
        num_hidden_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        intermediate_size=32,
        vocab_size=V,
        max_position_embeddings=16,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.BertForMaskedLM(config)


def llama():
    config = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=32,
        vocab_size=V,
        max_position_embeddings=16,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return transformers.LlamaForCausalLM(config)


def vit():
    config = transformers.ViTConfig(
        image_size=8,
        patch_size=4,
        num_channels=3,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.ViTForImageClassification(config)


def _model(make):
    torch.manual_seed(0)
    return curvopt.extend(make().to(DT).eval())


def _text(n=3, t=6):
    torch.manual_seed(1)
    ids = torch.randint(1, V, (n, t))
    return {"input_ids": ids}, ids


def _images(n=3):
    torch.manual_seed(1)
    return {"pixel_values": torch.randn(n, 3, 8, 8, dtype=DT)}, torch.randint(0, 3, (n,))


def _loss_of(kind):
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    if kind == "lm":  # next-token prediction, as GPT2LMHeadModel computes it
        return lambda out, y: lossfunc(out[:, :-1].flatten(0, 1), y[:, 1:].flatten())
    if kind == "mlm":
        return lambda out, y: lossfunc(out.flatten(0, 1), y.flatten())
    return lossfunc


PROBLEMS = {
    "gpt2": (gpt2, _text, "lm"),
    "bert": (bert, _text, "mlm"),
    "llama": (llama, _text, "lm"),
    "vit": (vit, _images, "cls"),
}


@pytest.mark.parametrize("name", list(PROBLEMS))
def test_against_torch_func(name):
    make, data, kind = PROBLEMS[name]
    model = _model(make)
    inputs, y = data()
    exts = [ext.BatchGrad(), ext.Variance(), ext.DiagGGNExact()]
    errors = curvopt.verify(model, _loss_of(kind), inputs, y, exts)
    assert len(errors) == len([p for p in model.parameters() if p.requires_grad])


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama"])
def test_first_order_with_the_models_own_labels_loss(name):
    """``model(input_ids, labels=...).loss`` (not an extended module) gives the per-sample
    gradients of the same loss written out with an extended loss."""
    make, data, kind = PROBLEMS[name]
    model = _model(make)
    inputs, ids = data()
    with curvopt.collect(ext.BatchGrad()):
        model(**inputs, labels=ids).loss.backward()
    got = {n: p.grad_batch.clone() for n, p in model.named_parameters()}
    curvopt.verify(model, _loss_of(kind), inputs, ids, [ext.BatchGrad()])
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad_batch, msg=n)


@pytest.mark.parametrize("name", list(PROBLEMS))
def test_every_quantity_is_written(name):
    make, data, kind = PROBLEMS[name]
    model = _model(make)
    inputs, y = data()
    skip = name == "vit"  # class token and position embeddings: raw 3-D parameters
    for extension in (ext.DiagGGNMC(), ext.KFAC(), ext.KFLR()):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with curvopt.collect(extension, skip_unsupported=skip) as ctx:
                _loss_of(kind)(model(**inputs).logits, y).backward()
        for n, p in model.named_parameters():
            assert hasattr(p, extension.attr) == (n not in ctx.skipped), (n, extension)
    if skip:
        assert set(ctx.skipped) == {
            "vit.embeddings.cls_token",
            "vit.embeddings.position_embeddings",
        }


def test_gpt2_kflr_of_conv1d_is_the_exact_block_for_one_token():
    """One sample, one position: ``kron(A, B)`` of every ``Conv1D`` weight is its GGN block."""
    model = _model(gpt2)
    ids = torch.randint(1, V, (1, 1))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    with curvopt.collect(ext.KFLR()):
        lossfunc(model(input_ids=ids).logits.flatten(0, 1), ids.flatten()).backward()
    ggn = curvopt.linalg.GGN(
        model,
        lossfunc,
        [({"input_ids": ids}, ids.flatten())],
        output=lambda o: o.logits.flatten(0, 1),
    )
    names = [n for n, p in model.named_parameters()]
    params = list(model.parameters())
    offsets = torch.tensor([0] + [p.numel() for p in params]).cumsum(0)
    checked = 0
    for i, (n, p) in enumerate(zip(names, params)):
        if not n.endswith("attn.c_proj.weight") and not n.endswith("mlp.c_fc.weight"):
            continue
        start, stop = int(offsets[i]), int(offsets[i + 1])
        eye = torch.zeros(ggn.shape[0], stop - start, dtype=DT)
        eye[start:stop] = torch.eye(stop - start, dtype=DT)
        block = torch.as_tensor(ggn @ eye.numpy())[start:stop]
        torch.testing.assert_close(torch.kron(*p.kflr), block, msg=n)
        checked += 1
    assert checked == 4


def _train(name, lr, damping, steps=30, **options):
    make, data, kind = PROBLEMS[name]
    model = _model(make)
    inputs, y = data(n=8)
    opt = curvopt.optim.KFAC(model.parameters(), lr=lr, damping=damping, **options)
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(steps):
            opt.zero_grad()
            loss = _loss_of(kind)(model(**inputs).logits, y)
            with opt.collect():
                loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize(
    "name, curvature, lr, bound",
    [
        ("gpt2", "kfac", 0.1, 0.9),
        ("gpt2", "kflr", 0.1, 0.7),
        ("bert", "kfac", 0.1, 0.6),
        ("llama", "kfac", 0.1, 0.7),
        ("vit", "kfac", 0.05, 0.6),
        ("vit", "kflr", 0.05, 0.3),
    ],
)
def test_optim_kfac_trains(name, curvature, lr, bound):
    """30 paper steps (``kl_clip=None``) on one batch of 8 (damping 0.03; the ViT's class token
    and position embeddings by ``fallback='diagonal'``): the loss falls below ``bound`` times
    its start."""
    fallback = "diagonal" if name == "vit" else None
    losses = _train(name, lr, 0.03, curvature=curvature, fallback=fallback, kl_clip=None)
    assert losses[-1] < bound * losses[0], losses


def _readme_snippet() -> str:
    """The README's "Hugging Face and timm" code block, as written."""
    text = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    return next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "GPT2LMHeadModel" in b)


def test_readme_snippet():
    scope = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(_readme_snippet(), "README", "exec"), scope)  # noqa: S102
    norms, vit = scope["norms"], scope["vit"]
    assert norms.shape == (8,) and bool((norms > 0).all())
    # against one sample's gradient norm, computed plainly (mean over 8 -> 1/8 scale)
    images, labels = scope["images"], scope["labels"]
    vit.zero_grad()
    loss = F.cross_entropy(vit(pixel_values=images[:1]).logits, labels[:1]) / 8
    grads = torch.autograd.grad(loss, [p for p in vit.parameters()])
    expected = torch.sqrt(sum((g**2).sum() for g in grads))
    torch.testing.assert_close(norms[0], expected, rtol=1e-4, atol=1e-7)
    assert all(hasattr(p, "kfac") for p in scope["model"].parameters())
