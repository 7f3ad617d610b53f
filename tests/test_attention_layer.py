"""``nn.MultiheadAttention`` as a first-class layer (``curvopt.layers.attention``), in float64.

* per-sample gradients against an eager backward of each sample's loss through the batch
  function, with the forward's generator state replayed (attention dropout in training mode:
  the same masks);
* Kronecker factors (KFLR "expand"/"reduce", EKFAC) against those of the twin with
  ``nn.Linear`` projections (``attention_twin``), the layout ``docs/conventions.md`` states;
* the GGN diagonal against the dense GGN of ``reference.ggn``.
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
from reference import ggn, per_sample_grads_replayed

DT = torch.float64
N, L, S, E, HEADS = 3, 4, 5, 6, 2


class Attend(nn.Module):
    """Tokens ``[N, L, 3]`` (and a memory ``[N, S, kdim]``) -> logits ``[N, 3]`` through one
    attention called as configured."""

    def __init__(self, sharing="self", batch_first=True, need_weights=False, masks=(),
                 dropout=0.0, **mha):
        super().__init__()
        self.embed = nn.Linear(3, E, dtype=DT)
        self.attn = nn.MultiheadAttention(E, HEADS, dropout=dropout, batch_first=batch_first,
                                          dtype=DT, **mha)
        self.head = nn.Linear(E, 3, dtype=DT)
        self.sharing, self.need_weights, self.masks = sharing, need_weights, masks
        self.batch_first = batch_first

    def forward(self, x, memory):
        h = self.embed(x)
        if not self.batch_first:
            h, memory = h.transpose(0, 1), memory.transpose(0, 1)
        key = h if self.sharing == "self" else memory
        value = key if self.sharing in ("self", "kv") else 2 * memory
        span = key.shape[1 if self.batch_first else 0]
        kwargs = {}
        if "key_padding" in self.masks:
            last = span - 1 - torch.arange(N)[:, None] % 2  # samples keep different keys
            kwargs["key_padding_mask"] = torch.arange(span).expand(N, span) >= last
        if "causal" in self.masks:
            kwargs["attn_mask"] = torch.ones(L, span, dtype=torch.bool).triu(1)
            kwargs["is_causal"] = span == L
        if "additive" in self.masks:
            kwargs["attn_mask"] = 0.3 * torch.arange(N * HEADS * L * span, dtype=DT).reshape(
                N * HEADS, L, span).sin()
        out, weights = self.attn(h, key, value, need_weights=self.need_weights, **kwargs)
        pooled = out.mean(1 if self.batch_first else 0)
        if self.need_weights:
            pooled = pooled + weights.flatten(1)[:, :E].tanh()
        return self.head(pooled)


CONFIGS = {
    "self": {},
    "seq_first": {"batch_first": False},
    "cross_kv": {"sharing": "kv"},
    "cross_none": {"sharing": "none"},
    "kdim": {"sharing": "kv", "kdim": 4, "vdim": 4},
    "kdim_seq_first": {"sharing": "none", "kdim": 4, "vdim": 4, "batch_first": False},
    "no_bias": {"bias": False},
    "key_padding": {"sharing": "kv", "masks": ("key_padding",)},
    "causal": {"masks": ("causal",)},
    "additive_mask": {"sharing": "kv", "masks": ("additive",)},
    "need_weights": {"need_weights": True},
    "need_weights_per_head": {"need_weights": True, "sharing": "kv"},
}
RANDOM = {
    "bias_kv_zero_attn": {"add_bias_kv": True, "add_zero_attn": True},
    "dropout": {"dropout": 0.3, "masks": ("key_padding",)},
    "dropout_weights": {"dropout": 0.3, "need_weights": True, "batch_first": False,
                        "sharing": "kv", "add_bias_kv": True},
}


def _problem(config, seed=0):
    torch.manual_seed(seed)
    plain = Attend(**config)
    kdim = config.get("kdim", E)
    x = torch.randn(N, L, 3, dtype=DT)
    memory = torch.randn(N, S, kdim, dtype=DT)
    y = torch.randint(0, 3, (N,))
    return plain, x, memory, y


def _collected(plain, x, memory, y, reduction, *extensions):
    """An extended copy after one pass; the generator state its forward started from."""
    model = curvopt.extend(copy.deepcopy(plain))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss(reduction=reduction))
    state = torch.get_rng_state()
    loss = lossfunc(model(x, memory), y)
    with curvopt.collect(*extensions):
        loss.backward()
    return model, state


def _per_sample_reference(plain, x, memory, y, reduction, state):
    """``g_n`` by an eager backward per sample, the forward's random numbers replayed."""
    scale = 1 / N if reduction == "mean" else 1.0

    def losses(net):
        return F.cross_entropy(net(x, memory), y, reduction="none") * scale

    return per_sample_grads_replayed(plain, losses, state)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", list(CONFIGS) + list(RANDOM))
def test_per_sample_gradients_equal_torch_func(name, reduction):
    config = {**CONFIGS, **RANDOM}[name]
    plain, x, memory, y = _problem(config)
    plain.train()
    model, state = _collected(plain, x, memory, y, reduction, ext.BatchGrad(), ext.Variance())
    expected = _per_sample_reference(plain, x, memory, y, reduction, state)
    for pname, p in model.named_parameters():
        torch.testing.assert_close(p.grad_batch, expected[pname], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(p.grad_batch.sum(0), p.grad, rtol=1e-10, atol=1e-12)
        g = p.grad_batch
        torch.testing.assert_close(p.variance, (g**2).mean(0) - g.mean(0) ** 2)


def _twin_values(plain, x, memory, y, reduction, make, attr):
    twin = with_twins(plain)
    model, _ = _collected(twin, x, memory, y, reduction, make())
    names = twin_names(plain)
    return {names.get(k, k): getattr(p, attr) for k, p in model.named_parameters()}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_kronecker_factors_equal_the_twins(name, approx, reduction):
    plain, x, memory, y = _problem(CONFIGS[name])
    model, _ = _collected(plain, x, memory, y, reduction, ext.KFLR(kfac_approx=approx))
    expected = _twin_values(
        plain, x, memory, y, reduction, lambda: ext.KFLR(kfac_approx=approx), "kflr"
    )
    for pname, p in model.named_parameters():
        if pname not in expected:  # separate q/k/v biases: in_proj_bias's block, below
            continue
        assert len(p.kflr) == len(expected[pname]), pname
        for got, want in zip(p.kflr, expected[pname]):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", ["self", "cross_kv", "kdim", "need_weights", "dropout"])
def test_ekfac_corrects_its_bases_with_the_per_sample_gradients(name, reduction):
    """``S = c Σ_n (Q_Bᵀ G_n Q_A)²`` in the bases ``EKFAC`` returns (``c``: ``N`` for "mean"),
    with ``G_n`` from ``torch.func``; the bases are the eigenvectors of the twin's KFAC factors
    (same draws), up to the arbitrary basis of repeated eigenvalues, so their spectra match."""
    config = {**CONFIGS, **RANDOM}[name]
    plain, x, memory, y = _problem(config)
    torch.manual_seed(5)
    model, state = _collected(plain, x, memory, y, reduction, ext.EKFAC(), ext.KFAC())
    expected = _per_sample_reference(plain, x, memory, y, reduction, state)
    c = N if reduction == "mean" else 1
    for pname, p in model.named_parameters():
        s_, *bases = p.ekfac
        g = expected[pname].reshape(N, bases[0].shape[0], -1)
        rotated = bases[0].T @ g @ (bases[1] if len(bases) == 2 else torch.ones(1, 1, dtype=DT))
        torch.testing.assert_close(s_, c * rotated.square().sum(0).reshape(s_.shape),
                                   rtol=1e-9, atol=1e-13)
        for basis, factor in zip(bases, p.kfac):
            spectrum = torch.diag(torch.linalg.eigvalsh(factor))
            torch.testing.assert_close(basis.T @ factor @ basis, spectrum, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", ["self", "seq_first", "kdim", "bias_kv_zero_attn", "need_weights"])
def test_ggn_diagonal_and_vector_blocks_equal_the_dense_ggn(name, reduction):
    config = {**CONFIGS, **RANDOM}[name]
    plain, x, memory, y = _problem(config)
    model, _ = _collected(plain, x, memory, y, reduction, ext.DiagGGNExact(), ext.KFLR())
    blocks, _ = ggn(plain, nn.CrossEntropyLoss(reduction=reduction), (x, memory), y)
    for pname, p in model.named_parameters():
        torch.testing.assert_close(
            p.diag_ggn_exact, torch.diagonal(blocks[pname]).reshape(p.shape), rtol=1e-9, atol=1e-12
        )
        if len(p.kflr) == 1:  # biases, bias_k/bias_v: the exact block
            torch.testing.assert_close(p.kflr[0], blocks[pname], rtol=1e-9, atol=1e-12)
