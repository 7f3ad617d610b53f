"""The models people train, in training mode, with only the optimizer line changed (issue 51,
"Done when"): ``torch.optim.AdamW(model.parameters(), lr=...)`` becomes
``curvopt.optim.KFAC(...)``, ``EKFAC(...)`` or ``DiagGGNNewton(...)`` with their defaults
(``damping=1e-3``, ``kl_clip=1e-3``, the Kronecker optimizers' ``fallback="diagonal"``), plus
the one ``curvopt.extend(model)`` the contract asks for. The loss is the one users write
(``F.cross_entropy`` on the logits, or the model's own ``labels=`` loss).

* a small ResNet: conv, ``BatchNorm2d``, ReLU blocks with a skip (BatchNorm in training mode:
  batch statistics, running statistics updated);
* ``nn.TransformerEncoder`` classifiers, batch-first and sequence-first, ``norm_first=True``,
  ``dropout=0.1``;
* ``nn.Transformer`` sequence to sequence (``dropout=0.1``, a causal target mask);
* a ViT: patch convolution, a class token and a position embedding as raw ``nn.Parameter``,
  dropout 0.1, ``nn.TransformerEncoder``;
* peft LoRA (``c_attn``, ``lora_dropout=0.1``) on a tiny GPT-2 sequence classifier (its
  ``score`` head trained too, as peft's ``SEQ_CLS`` task does), dropout 0.1 everywhere.

"Trains": on a fixed set of four batches of 16, the mean loss of the last pass over them is
below a fraction of that of the first pass. The fractions are about 1.3x to 2x the measured
ones (float32, seed 0, one thread), so a model that does not learn fails: measured last/first
(KFAC, EKFAC, DiagGGNNewton) ResNet 0.32, -, 0.37; encoders 0.42-0.44, 0.28-0.30, 0.31;
nn.Transformer 0.62-0.64 (40 steps); ViT < 0.01; LoRA 0.61, 0.60, 0.59 (40 steps). AdamW at
``lr=1e-2`` on the same batches: 0.41, 0.25-0.27, 0.73 (30 steps), 0.01, 0.67.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import curvopt
from fixtures import zoo

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers' deprecations

LR = 0.1
BATCH, BATCHES = 16, 4


# ------------------------------------------------------------------------------ the models


def resnet():
    return zoo.resnet(width=8, blocks=2)


class EncoderClassifier(nn.Module):
    """Token embedding, a 2-layer pre-norm ``nn.TransformerEncoder`` (dropout 0.1), mean
    pooled, a linear head; ``batch_first=False`` runs sequence-first as torch's tutorials do."""

    def __init__(self, batch_first, vocab=20, d=16, classes=4):
        super().__init__()
        self.batch_first = batch_first
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(
            d, 2, 32, dropout=0.1, batch_first=batch_first, norm_first=True
        )
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, idx):
        h = self.embed(idx if self.batch_first else idx.t())
        return self.head(self.enc(h).mean(1 if self.batch_first else 0))


class Seq2Seq(nn.Module):
    """``nn.Transformer`` (dropout 0.1) with a shared embedding and a causal target mask."""

    def __init__(self, vocab=12, d=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.tf = nn.Transformer(d, 2, 1, 1, 32, dropout=0.1, batch_first=True)
        self.head = nn.Linear(d, vocab)

    def forward(self, src, tgt):
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        out = self.tf(self.embed(src), self.embed(tgt), tgt_mask=mask, tgt_is_causal=True)
        return self.head(out)


class ViT(nn.Module):
    """Patches by a strided convolution, a class token and a position embedding (raw
    parameters), dropout 0.1, a pre-norm ``nn.TransformerEncoder``, the class token's head."""

    def __init__(self, d=16, classes=4, patch=4, size=16):
        super().__init__()
        self.patch = nn.Conv2d(3, d, patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        self.pos = nn.Parameter(0.02 * torch.randn(1, (size // patch) ** 2 + 1, d))
        self.drop = nn.Dropout(0.1)
        layer = nn.TransformerEncoderLayer(d, 2, 32, dropout=0.1, batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, classes)

    def forward(self, x):
        h = self.patch(x).flatten(2).transpose(1, 2)
        h = torch.cat([self.cls.expand(h.shape[0], -1, -1), h], 1)
        h = self.enc(self.drop(h + self.pos))
        return self.head(self.norm(h[:, 0]))


def lora_gpt2():
    """peft LoRA on ``c_attn`` of a tiny GPT-2 sequence classifier (pad id 0)."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2, num_labels=4,
        pad_token_id=0, bos_token_id=1, eos_token_id=1,
    )  # fmt: skip
    base = transformers.GPT2ForSequenceClassification(config)
    lora = peft.LoraConfig(
        task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.1,
        fan_in_fan_out=True,  # GPT-2's Conv1D
    )  # fmt: skip
    return peft.get_peft_model(base, lora)


# ------------------------------------------------------------------------------ the data


def batches(name, gen):
    """Four fixed batches ``(inputs, targets)`` with learnable targets."""
    out = []
    if name in ("resnet", "vit"):
        size = 8 if name == "resnet" else 16
        w = torch.randn(3, 4, generator=gen)
        for _ in range(BATCHES):
            x = torch.randn(BATCH, 3, size, size, generator=gen)
            if name == "vit":
                x[:, :, :8, :8] += 1.0
            out.append(((x,), (x[:, :, :8, :8].mean((2, 3)) @ w).argmax(1)))
    elif name.startswith("encoder"):
        for _ in range(BATCHES):
            idx = torch.randint(0, 20, (BATCH, 8), generator=gen)
            out.append(((idx,), (idx % 4).mode(1).values))  # the most frequent residue
    elif name == "seq2seq":
        for _ in range(BATCHES):
            src = torch.randint(2, 12, (BATCH, 6), generator=gen)
            tgt = src.flip(1)  # reverse the sequence; 1 is the start token
            tgt_in = torch.cat([torch.ones(BATCH, 1, dtype=torch.long), tgt[:, :-1]], 1)
            out.append(((src, tgt_in), tgt))
    elif name == "lora":
        for _ in range(BATCHES):
            idx = torch.randint(1, 50, (BATCH, 10), generator=gen)
            out.append(((idx,), idx[:, -1] % 4))
    return out


MODELS = {
    "resnet": resnet,
    "encoder_batch_first": lambda: EncoderClassifier(True),
    "encoder_sequence_first": lambda: EncoderClassifier(False),
    "seq2seq": Seq2Seq,
    "vit": ViT,
    "lora": lora_gpt2,
}
#: steps: passes over the four batches
STEPS = {"seq2seq": 40, "lora": 40}
#: the last pass's mean loss must be below this fraction of the first's
BOUND = {
    "resnet": 0.6,
    "encoder_batch_first": 0.6,
    "encoder_sequence_first": 0.6,
    "seq2seq": 0.8,
    "vit": 0.3,
    "lora": 0.8,
}

OPTIMIZERS = {
    "AdamW": lambda params: torch.optim.AdamW(params, lr=1e-2),  # the line users replace
    "KFAC": lambda params: curvopt.optim.KFAC(params, lr=LR),
    "EKFAC": lambda params: curvopt.optim.EKFAC(params, lr=LR),
    "DiagGGNNewton": lambda params: curvopt.optim.DiagGGNNewton(params, lr=LR),
}


def loss_of(name, model, inputs, targets):
    if name == "lora":  # the model's own labels= loss
        return model(input_ids=inputs[0], labels=targets).loss
    out = model(*inputs)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1))


def train(name, optimizer):
    """``(losses, model)``: the script users run, the optimizer line aside."""
    torch.manual_seed(0)
    model = MODELS[name]()
    if optimizer != "AdamW":
        model = curvopt.extend(model)
    model.train()
    data = batches(name, torch.Generator().manual_seed(0))
    opt = OPTIMIZERS[optimizer](model.parameters())
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the diagonal fallback's announcement, transformers'
        for step in range(STEPS.get(name, 30)):
            inputs, targets = data[step % BATCHES]
            opt.zero_grad()
            loss = loss_of(name, model, inputs, targets)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses, model


CASES = [(name, opt) for name in MODELS for opt in ("KFAC", "EKFAC", "DiagGGNNewton")]


@pytest.mark.parametrize("name, optimizer", CASES)
def test_model_trains_with_only_the_optimizer_line_changed(name, optimizer):
    before = {n: p.detach().clone() for n, p in _fresh(name).named_parameters()}
    losses, model = train(name, optimizer)
    assert all(math.isfinite(v) for v in losses), losses
    first, last = sum(losses[:BATCHES]) / BATCHES, sum(losses[-BATCHES:]) / BATCHES
    assert last < BOUND[name] * first, (first, last, losses)
    assert model.training
    if name == "seq2seq":  # below the uniform guess over the 10 tokens: more than frequencies
        assert last < math.log(10), losses
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trained
    for n, p in trained.items():  # every trainable parameter moved, none non-finite
        assert p.isfinite().all(), n
        assert not torch.equal(p.detach(), before[n]), f"{n} did not move"
    if name == "resnet":  # BatchNorm ran on batch statistics: its running statistics moved
        for bn in (m for m in model.modules() if isinstance(m, nn.BatchNorm2d)):
            assert bn.num_batches_tracked.item() == STEPS.get(name, 30)
            assert not torch.equal(bn.running_mean, torch.zeros_like(bn.running_mean))
    if name == "lora":  # the adapters trained (lora_B starts at zero), the base stayed
        names = [n for n in trained if "lora_" in n]
        assert len(names) == 2 and all(trained[n].abs().sum() > 0 for n in names)
        frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
        assert frozen and all(
            torch.equal(dict(model.named_parameters())[n], before[n]) for n in frozen
        )


def _fresh(name):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return MODELS[name]()


@pytest.mark.parametrize("name", ["resnet", "encoder_batch_first", "vit"])
def test_the_adamw_script_it_replaces_trains_on_the_same_batches(name):
    """The baseline the bounds were set against: the same script with AdamW."""
    losses, model = train(name, "AdamW")
    first, last = sum(losses[:BATCHES]) / BATCHES, sum(losses[-BATCHES:]) / BATCHES
    assert last < BOUND[name] * first, losses
