"""torch's transformer layers as users build them, in training mode with dropout, in float64.

``nn.TransformerEncoder`` classifiers (batch first and sequence first, ``norm_first``, GELU,
padding and causal masks) and ``nn.Transformer`` sequence to sequence: per-sample gradients
against ``torch.func.jacrev`` of the per-sample losses of the batch function, the forward's
random numbers replayed (the dropout masks are part of the function), and the Kronecker
factors of the attention against those of its twin with ``nn.Linear`` projections.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import curvopt
from curvopt import extensions as ext
from attention_twin import twin_names, with_twins
from reference import per_sample_grads_replayed

DT = torch.float64
N, T, D, VOCAB = 3, 5, 8, 4


class EncoderClassifier(nn.Module):
    def __init__(self, batch_first=True, norm_first=False, activation="relu", dropout=0.1,
                 masks=False):
        super().__init__()
        self.batch_first, self.masks = batch_first, masks
        self.embed = nn.Linear(3, D, dtype=DT)
        layer = nn.TransformerEncoderLayer(D, 2, 16, dropout=dropout, activation=activation,
                                           batch_first=batch_first, norm_first=norm_first,
                                           dtype=DT)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(D, 3, dtype=DT)

    def forward(self, x):
        h = self.embed(x if self.batch_first else x.transpose(0, 1))
        kwargs = {}
        if self.masks:
            kwargs["mask"] = nn.Transformer.generate_square_subsequent_mask(T, dtype=DT)
            kwargs["src_key_padding_mask"] = torch.arange(T) >= T - 1 - torch.arange(N)[:, None]
        h = self.encoder(h, **kwargs)
        return self.head(h.mean(1 if self.batch_first else 0))


class Seq2Seq(nn.Module):
    def __init__(self, batch_first=True, dropout=0.1):
        super().__init__()
        self.batch_first = batch_first
        self.embed = nn.Linear(3, D, dtype=DT)
        self.tf = nn.Transformer(D, 2, 1, 1, 16, dropout=dropout, batch_first=batch_first,
                                 dtype=DT)
        self.head = nn.Linear(D, VOCAB, dtype=DT)

    def forward(self, x):
        src = self.embed(x if self.batch_first else x.transpose(0, 1))
        tgt = src.flip(1 if self.batch_first else 0)
        mask = nn.Transformer.generate_square_subsequent_mask(T, dtype=DT)
        out = self.head(self.tf(src, tgt, tgt_mask=mask, tgt_is_causal=True))
        return out if self.batch_first else out.transpose(0, 1)  # [N, T, VOCAB]


MODELS = {
    "encoder": lambda: EncoderClassifier(),
    "encoder_seq_first": lambda: EncoderClassifier(batch_first=False),
    "encoder_norm_first_gelu": lambda: EncoderClassifier(norm_first=True, activation="gelu"),
    "encoder_masks": lambda: EncoderClassifier(masks=True),
    "transformer": lambda: Seq2Seq(),
    "transformer_seq_first": lambda: Seq2Seq(batch_first=False),
}


def _data(name, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, T, 3, generator=g, dtype=DT)
    if name.startswith("transformer"):
        return x, torch.randint(0, VOCAB, (N, T), generator=g)
    return x, torch.randint(0, 3, (N,), generator=g)


def _loss(out, y, reduction):
    """The flattened cross-entropy, through an extended loss module: it is where curvopt finds
    the batch of a sequence-first model's position-wise layers (``docs/conventions.md``)."""
    lossfunc = curvopt.extend(nn.CrossEntropyLoss(reduction=reduction))
    return lossfunc(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _per_sample_reference(plain, x, y, reduction, state):
    rows = y[0].numel()  # loss rows per sample (a flattened sequence mean divides by N T)

    def losses(net):
        out = net(x)
        per_row = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="none")
        per_sample = per_row.reshape(N, rows).sum(1)
        return per_sample / (N * rows) if reduction == "mean" else per_sample

    return per_sample_grads_replayed(plain, losses, state)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", list(MODELS))
def test_per_sample_gradients_in_training_mode_with_dropout(name, reduction):
    torch.manual_seed(0)
    plain = MODELS[name]().train()
    x, y = _data(name)
    model = curvopt.extend(copy.deepcopy(plain))
    state = torch.get_rng_state()
    loss = _loss(model(x), y, reduction)
    with curvopt.collect(ext.BatchGrad()):
        loss.backward()
    expected = _per_sample_reference(plain, x, y, reduction, state)
    for pname, p in model.named_parameters():
        torch.testing.assert_close(p.grad_batch, expected[pname], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize("name", list(MODELS))
def test_attention_factors_equal_the_twins_in_whole_models(name, approx):
    """Without dropout (the twin has none): every parameter's KFLR factors, the attention's
    against its twin's ``nn.Linear`` projections."""
    torch.manual_seed(0)
    plain = MODELS[name]()
    for module in plain.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(module, nn.MultiheadAttention):
            module.dropout = 0.0
    x, y = _data(name)
    values = []
    for net in (plain, with_twins(plain)):
        # the twin has no layer with a fixed batch dim to tell [T, N] from [N, T]: declared
        declared = net is not plain and not net.batch_first
        model = curvopt.extend(copy.deepcopy(net), sequence_first=declared)
        with curvopt.collect(ext.KFLR(kfac_approx=approx)):
            _loss(model(x), y, "mean").backward()
        values.append({k: p.kflr for k, p in model.named_parameters()})
    renamed = twin_names(plain)
    twin = {renamed.get(k, k): v for k, v in values[1].items()}
    for pname, factors in values[0].items():
        assert len(factors) == len(twin[pname]), pname
        for got, want in zip(factors, twin[pname]):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
