"""laplace-torch's ``hessian_structure="kron"`` on ``nn.TransformerEncoder`` classifiers through
``curvopt.laplace`` (issue 51, item 7), float64.

The classifier is built as users train it (``dropout=0.1``, ``norm_first=True``, a padding mask
from the pad id, batch-first or sequence-first); ``Laplace.fit`` puts it in eval mode itself
(laplace-torch 0.3 calls ``model.eval()`` before its pass over the data; curvopt's backends
do not change the mode), so the curvature is that of the trained network without dropout.

The reference is its twin: the same network with each ``nn.MultiheadAttention`` replaced by
``attention_twin.TwinAttention`` (``nn.Linear`` projections, explicit softmax attention), whose
Kronecker factors are those of ``nn.Linear`` layers, the layout the contract fixes for the
attention's ``in_proj_weight``/``out_proj``. Fitted by the same backend, the log marginal
likelihoods and every Kronecker factor agree to 1e-9 relative, for ``CurvoptGGN`` (KFLR) and
``CurvoptEF`` (empirical KFAC), with ``kfac_approx`` ``"expand"`` and ``"reduce"``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from attention_twin import with_twins
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import curvopt

pytest.importorskip("laplace")
from laplace import Laplace  # noqa: E402

from curvopt.laplace import CurvoptEF, CurvoptGGN  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

DT = torch.float64
VOCAB, LENGTH, WIDTH, CLASSES, N = 10, 6, 8, 3, 14


class EncoderClassifier(nn.Module):
    """Token embedding, a 2-layer pre-norm encoder (dropout 0.1) with the padding mask of pad
    id 0, mean pooled over the tokens that are not padding, a linear head."""

    def __init__(self, batch_first: bool):
        super().__init__()
        self.batch_first = batch_first
        self.embed = nn.Embedding(VOCAB, WIDTH)
        layer = nn.TransformerEncoderLayer(
            WIDTH, 2, 16, dropout=0.1, batch_first=batch_first, norm_first=True
        )
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, idx):
        pad = idx == 0
        h = self.embed(idx if self.batch_first else idx.t())
        h = self.enc(h, src_key_padding_mask=pad)
        if not self.batch_first:
            h = h.transpose(0, 1)
        keep = (~pad).unsqueeze(-1).to(h.dtype)
        return self.head((h * keep).sum(1) / keep.sum(1))


def _problem(batch_first):
    torch.manual_seed(0)
    model = EncoderClassifier(batch_first).to(DT)
    idx = torch.randint(1, VOCAB, (N, LENGTH))
    lengths = torch.randint(2, LENGTH + 1, (N,))
    idx = idx * (torch.arange(LENGTH) < lengths[:, None])  # pad id 0 after each sequence
    labels = torch.randint(0, CLASSES, (N,))
    return model, DataLoader(TensorDataset(idx, labels), batch_size=5)


def _twin(model):
    """The twin (attention dropout set to 0 first: the twin has none; in eval mode the
    function is the same); a sequence-first twin declares its layout, since no layer of it
    has a fixed batch dim (the attention's ``batch_first`` tells curvopt otherwise)."""
    model = copy.deepcopy(model)
    for module in model.modules():
        if isinstance(module, nn.MultiheadAttention):
            module.dropout = 0.0
    twin = with_twins(model)
    return curvopt.extend(twin, sequence_first=True) if not model.batch_first else twin


def _fit(model, loader, backend, approx, twin):
    la = Laplace(
        model,
        "classification",
        subset_of_weights="all",
        hessian_structure="kron",
        backend=backend,
        backend_kwargs={"kfac_approx": approx},
        prior_precision=1.0,
    )
    # torch's encoder checks its fast path's conditions on the attention's attributes in eval
    # mode, which the twin does not have; the fast path never runs with gradients anyway
    enabled = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(not twin)
    try:
        la.fit(loader)
        lml = la.log_marginal_likelihood()
    finally:
        torch.backends.mha.set_fastpath_enabled(enabled)
    return la, lml


@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize("backend", [CurvoptGGN, CurvoptEF], ids=["GGN", "EF"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "sequence_first"])
def test_kron_laplace_of_an_encoder_equals_its_twins(batch_first, backend, approx):
    model, loader = _problem(batch_first)
    model.train()  # as trained; Laplace switches to eval itself
    la, lml = _fit(copy.deepcopy(model), loader, backend, approx, twin=False)
    assert not la.model.training
    la_twin, lml_twin = _fit(_twin(model), loader, backend, approx, twin=True)

    assert torch.isfinite(lml)
    torch.testing.assert_close(lml, lml_twin, rtol=1e-9, atol=0)

    params = [n for n, p in la.model.named_parameters() if p.requires_grad]
    kfacs, twin_kfacs = la.H_facs.kfacs, la_twin.H_facs.kfacs
    assert len(kfacs) == len(twin_kfacs) == len(params)
    for name, factors, want in zip(params, kfacs, twin_kfacs):
        assert len(factors) == len(want), name
        for got, ref in zip(factors, want):
            torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-12 * ref.abs().max().item())
    # the attention's projections got curvature, the layout of nn.Linear(d, 3d) and (d, d)
    for name in ("enc.layers.0.self_attn.in_proj_weight", "enc.layers.1.self_attn.out_proj.weight"):
        factors = kfacs[params.index(name)]
        assert [f.shape[0] for f in factors] == (
            [3 * WIDTH, WIDTH] if "in_proj" in name else [WIDTH, WIDTH]
        )
        assert all(torch.trace(f) > 0 for f in factors), name


def test_the_kron_laplace_depends_on_the_attention_factors():
    """The comparison can fail: zeroing the attention's factors changes the marginal
    likelihood by far more than the tolerance."""
    model, loader = _problem(True)
    la, lml = _fit(copy.deepcopy(model), loader, CurvoptGGN, "expand", twin=False)
    params = [n for n, p in la.model.named_parameters() if p.requires_grad]
    index = params.index("enc.layers.0.self_attn.in_proj_weight")
    la.H_facs.kfacs[index] = [torch.zeros_like(f) for f in la.H_facs.kfacs[index]]
    la.H = la.H_facs.decompose(damping=False)
    changed = la.log_marginal_likelihood()
    assert (changed - lml).abs() > 1e-4 * lml.abs()
