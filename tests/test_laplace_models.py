"""``curvopt.laplace`` end to end on models laplace-torch's BackPACK and curvlinops backends
cannot run: a transformer classifier (LayerNorm, ``scaled_dot_product_attention``), a model
whose embedding and head share one weight, and Hugging Face's ``GPT2ForSequenceClassification``
with dict batches and a padding mask (a tiny local config, no download); and the transformer
with a regression head.

Each: ``Laplace.fit`` with ``full``, ``kron`` and ``diag`` and both backends,
``optimize_prior_precision``, the GLM predictive (probit and Monte-Carlo links) and the sampled
network predictive. The reference is laplace's own torch.func implementation
(``GGNInterface``/``EFInterface`` with their ``jacrev``/``vmap`` Jacobians and gradients), in
float64: the full curvature and the diagonal, and so the log marginal likelihoods, agree with
it; ``kron``'s blocks of one-dimensional parameters (exact blocks) equal those of ``full``.
"""

import copy

import pytest
import torch
from conftest import DT
from fixtures.laplace_models import DictBatches, GPT2Classifier, Transformer, collate
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("laplace")
from laplace import Laplace  # noqa: E402
from laplace.curvature import EFInterface, GGNInterface  # noqa: E402

from curvopt.laplace import CurvoptEF, CurvoptGGN  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

VOCAB, LENGTH, WIDTH, CLASSES, N = 10, 5, 8, 3, 12


def _problem(name):
    """``(model, loader, test_batch)``."""
    torch.manual_seed(0)
    idx = torch.randint(1, VOCAB, (N + 4, LENGTH))
    if name == "gpt2":
        lengths = torch.randint(2, LENGTH + 1, (N + 4,))
        mask = (torch.arange(LENGTH) < lengths[:, None]).long()
        idx = idx * mask  # pad id 0 after each sequence
        labels = torch.randint(0, CLASSES, (N + 4,))
        data = DictBatches(idx[:N], mask[:N], labels[:N])
        test = collate([DictBatches(idx, mask, labels)[i] for i in range(N, N + 4)])
        model = GPT2Classifier(VOCAB, LENGTH, WIDTH, CLASSES).to(DT).eval()
        return model, DataLoader(data, 5, collate_fn=collate), test
    model = Transformer(VOCAB, LENGTH, WIDTH, CLASSES, tied=name == "tied").to(DT)
    labels = torch.randint(0, VOCAB if name == "tied" else CLASSES, (N + 4,))
    if name == "regression":
        labels = torch.randn(N + 4, CLASSES, dtype=DT)
    return model, DataLoader(TensorDataset(idx[:N], labels[:N]), batch_size=5), idx[N:]


def _fit(model, loader, structure, backend, likelihood="classification"):
    la = Laplace(
        copy.deepcopy(model),
        likelihood,
        subset_of_weights="all",
        hessian_structure=structure,
        backend=backend,
        prior_precision=1.0,
    )
    la.fit(loader)
    return la


def _close(got, want, rtol=1e-9):
    torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * want.abs().max().item())


def _one_dimensional_blocks(model):
    """``(index in Kron, slice of vec θ)`` of each one-dimensional parameter."""
    start, blocks = 0, []
    for index, p in enumerate(p for p in model.parameters() if p.requires_grad):
        if p.dim() == 1:
            blocks.append((index, slice(start, start + p.numel())))
        start += p.numel()
    return blocks


@pytest.mark.parametrize("kind", ["ggn", "ef"])
@pytest.mark.parametrize("name", ["transformer", "tied", "gpt2", "regression"])
def test_end_to_end(name, kind):
    model, loader, test = _problem(name)
    backend = CurvoptGGN if kind == "ggn" else CurvoptEF
    likelihood = "regression" if name == "regression" else "classification"
    fits = {s: _fit(model, loader, s, backend, likelihood) for s in ("full", "diag", "kron")}
    # the reference: laplace's own torch.func curvature (no per-sample vmap over dict batches)
    reference = GGNInterface if kind == "ggn" else EFInterface
    if not (kind == "ef" and name == "gpt2"):
        for structure in ("full", "diag"):
            want = _fit(model, loader, structure, reference, likelihood)
            _close(fits[structure].H, want.H)
            _close(fits[structure].log_marginal_likelihood(), want.log_marginal_likelihood())
    full = fits["full"].H
    _close(fits["diag"].H, full.diagonal())
    for index, block in _one_dimensional_blocks(model):
        _close(fits["kron"].H_facs.kfacs[index][0], full[block, block])
    for structure, la in fits.items():
        assert torch.isfinite(la.log_marginal_likelihood()), structure
        la.optimize_prior_precision(method="marglik", pred_type="glm", n_steps=20)
        assert torch.isfinite(la.prior_precision).all(), structure
        if likelihood == "regression":
            for pred_type in ("glm", "nn"):
                link = "mc" if pred_type == "nn" else "probit"
                mean, var = la(test, pred_type=pred_type, link_approx=link, n_samples=5)
                assert mean.shape == (4, CLASSES) and torch.isfinite(var).all(), pred_type
                assert (torch.diagonal(var, dim1=-2, dim2=-1) > 0).all(), pred_type
            continue
        for kwargs in (
            dict(pred_type="glm", link_approx="probit"),
            dict(pred_type="glm", link_approx="mc", n_samples=20),
            dict(pred_type="nn", link_approx="mc", n_samples=5),
        ):
            probs = la(test, **kwargs)
            assert probs.shape == (4, VOCAB if name == "tied" else CLASSES), (structure, kwargs)
            assert torch.isfinite(probs).all(), (structure, kwargs)
            _close(probs.sum(-1), torch.ones(4, dtype=DT))


def test_dict_batches_match_tensor_batches():
    """The HF model through its dict wrapper has the GGN of the same model on tensors."""
    model, loader, _ = _problem("gpt2")
    got = _fit(model, loader, "kron", CurvoptGGN)

    class Tensors(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner({"input_ids": x[:, 0], "attention_mask": x[:, 1]})

    batches = [(torch.stack([b["input_ids"], b["attention_mask"]], 1), b["labels"]) for b in loader]
    tensors = DataLoader(
        TensorDataset(torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])), 5
    )
    want = _fit(Tensors(copy.deepcopy(model)), tensors, "kron", CurvoptGGN)
    for g, w in zip(got.H_facs.kfacs, want.H_facs.kfacs):
        for a, b in zip(g, w):
            _close(a, b)
