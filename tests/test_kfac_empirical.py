"""``KFACEmpirical`` (``p.kfac_empirical``): Kronecker factors of the empirical Fisher.

References, all in float64:

* brute force: with one sample and no weight sharing, ``kron(*p.kfac_empirical)`` is the EF
  block ``c g gᵀ`` (``g`` the gradient of the loss from ``torch.autograd``, ``c`` the loss's
  divisor) exactly;
* dense factors from the plain model's layer inputs and output gradients (forward hooks, one
  ``torch.autograd.grad``): ``B = c sum δ δᵀ`` and ``A`` the mean ``x xᵀ``, over samples and
  positions for ``"expand"``, of the position sums / means for ``"reduce"``; a bias gets its
  exact EF block; on a sequence model with flattened CE and ``ignore_index``, and a conv with
  stride and padding;
* curvlinops' ``KFACLinearOperator(fisher_type="empirical")`` where both define the same thing
  (its bias factor under ``"expand"`` is the weight's ``B``, an approximation, not the block);
* every layer family: KFAC with the sampler forced to draw the observed labels is KFACEmpirical.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import DT, Conv1D
from torch import nn

import curvopt
from curvopt import extensions as ext
from curvopt.errors import UnsupportedKroneckerError
from curvopt.losses import cross_entropy


def _factors(model, lossfunc, x, y, **options):
    model = curvopt.extend(model)
    lossfunc = curvopt.extend(lossfunc)
    with curvopt.collect(ext.KFACEmpirical(**options)):
        lossfunc(model(x), y).backward()
    return {name: p.kfac_empirical for name, p in model.named_parameters()}


def _block(factors):
    return torch.kron(*factors) if len(factors) == 2 else factors[0]


def _mlp():
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DT)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("loss", ["ce", "ce_weighted", "mse", "bce"])
def test_one_sample_is_the_empirical_fisher_block(loss, reduction):
    torch.manual_seed(0)
    model = _mlp()
    x = torch.randn(1, 4, dtype=DT)
    mean = reduction == "mean"
    if loss == "ce":
        lossfunc, y, divisor = nn.CrossEntropyLoss(reduction=reduction), torch.tensor([2]), 1
    elif loss == "ce_weighted":  # "mean" divides by the target's class weight
        weight = torch.tensor([0.5, 1.0, 3.0], dtype=DT)
        lossfunc = nn.CrossEntropyLoss(weight=weight, reduction=reduction, label_smoothing=0.1)
        y, divisor = torch.tensor([2]), 3.0 if mean else 1
    elif loss == "mse":
        lossfunc, y = nn.MSELoss(reduction=reduction), torch.randn(1, 3, dtype=DT)
        divisor = 3 if mean else 1  # "mean" divides by N K
    else:
        lossfunc, y = nn.BCEWithLogitsLoss(reduction=reduction), torch.rand(1, 3, dtype=DT)
        divisor = 3 if mean else 1
    plain = copy.deepcopy(model)
    grads = torch.autograd.grad(lossfunc(plain(x), y), list(plain.parameters()))
    got = _factors(model, lossfunc, x, y)
    for (name, _), g in zip(plain.named_parameters(), grads):
        want = divisor * torch.outer(g.flatten(), g.flatten())
        torch.testing.assert_close(_block(got[name]), want, rtol=1e-10, atol=1e-14)


def _inputs_and_output_grads(model, lossfunc, x, y):
    """``module -> (input, d loss / d output)`` of every Linear/Conv2d of the plain model."""
    seen = {}

    def hook(module, args, out):
        out.retain_grad()
        seen[module] = (args[0].detach(), out)

    layers = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    handles = [m.register_forward_hook(hook) for m in layers]
    lossfunc(model(x), y).backward()
    for h in handles:
        h.remove()
    return {m: (inp, out.grad) for m, (inp, out) in seen.items()}


def _dense_reference(module, inp, delta, divisor, approx):
    """``(weight factors [B, A], bias block)`` from the inputs ``[N, T, I]`` and output gradients
    ``[N, T, O]`` (positions ``T``)."""
    if isinstance(module, nn.Conv2d):
        inp = F.unfold(inp, module.kernel_size, padding=module.padding, stride=module.stride)
        inp, delta = inp.transpose(1, 2), delta.flatten(2).transpose(1, 2)
    inp = inp.reshape(inp.shape[0], -1, inp.shape[-1])
    delta = delta.reshape(delta.shape[0], -1, delta.shape[-1])
    n, t = inp.shape[:2]
    summed = delta.sum(1)
    bias = divisor * summed.T @ summed
    if approx == "expand":
        a = inp.reshape(n * t, -1)
        d = delta.reshape(n * t, -1)
        return [divisor * d.T @ d, a.T @ a / (n * t)], bias
    mean = inp.mean(1)
    return [divisor * summed.T @ summed, mean.T @ mean / n], bias


class _Tagger(nn.Module):
    """A sequence model: ``[N, T, 4]`` features to ``[N T, 7]`` flattened logits."""

    def __init__(self):
        super().__init__()
        self.lin, self.head = nn.Linear(4, 5), nn.Linear(5, 7)

    def forward(self, x):
        return self.head(torch.tanh(self.lin(x))).reshape(-1, 7)


def _cnn():
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, stride=2, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(27, 4)
    ).to(DT)


def _case(name, reduction, batch=5):
    """``(model, loss, x, y, divisor)``."""
    if name == "mlp":
        y = torch.randint(0, 3, (batch,))
        return _mlp(), nn.CrossEntropyLoss(reduction=reduction), torch.randn(batch, 4, dtype=DT), y
    if name == "cnn":
        y = torch.randint(0, 4, (batch,))
        x = torch.randn(batch, 2, 6, 6, dtype=DT)
        return _cnn(), nn.CrossEntropyLoss(reduction=reduction), x, y
    y = torch.randint(0, 7, (batch * 6,))
    y[torch.rand(batch * 6) < 0.3] = -100
    x = torch.randn(batch, 6, 4, dtype=DT)
    return _Tagger().to(DT), nn.CrossEntropyLoss(reduction=reduction), x, y


def _divisor(lossfunc, y):
    return 1 if lossfunc.reduction == "sum" else int((y != -100).sum())


@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name,batch", [("mlp", 5), ("cnn", 5), ("tagger", 4), ("tagger", 1)])
def test_factors_against_dense_reference(name, batch, reduction, approx):
    torch.manual_seed(0)
    model, lossfunc, x, y = _case(name, reduction, batch)
    plain = copy.deepcopy(model)
    got = _factors(model, lossfunc, x, y, kfac_approx=approx)
    names = {m: n for n, m in plain.named_modules()}
    for module, (inp, delta) in _inputs_and_output_grads(plain, lossfunc, x, y).items():
        weight, bias = _dense_reference(module, inp, delta, _divisor(lossfunc, y), approx)
        for got_f, want_f in zip(got[names[module] + ".weight"], weight):
            torch.testing.assert_close(got_f, want_f, rtol=1e-10, atol=1e-13)
        torch.testing.assert_close(got[names[module] + ".bias"][0], bias, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", ["mlp", "cnn", "tagger"])
def test_against_curvlinops_empirical_kfac(name, reduction, approx):
    curvlinops = pytest.importorskip("curvlinops")
    torch.manual_seed(0)
    model, lossfunc, x, y = _case(name, reduction)
    y[y == -100] = 0  # curvlinops divides a "mean" by all rows, not the kept ones
    op = curvlinops.KFACLinearOperator(
        model,
        lossfunc,
        list(model.parameters()),
        [(x, y)],
        fisher_type="empirical",
        kfac_approx=approx,
        separate_weight_and_bias=True,
        check_deterministic=False,
        num_per_example_loss_terms=y.numel() // x.shape[0],
    )
    op.compute_kronecker_factors()
    got = _factors(copy.deepcopy(model), lossfunc, x, y, kfac_approx=approx)
    for name_ in op._mapping:
        a, b = op._input_covariances[name_], op._gradient_covariances[name_]
        want = torch.kron(b, a)
        torch.testing.assert_close(_block(got[name_ + ".weight"]), want, rtol=1e-10, atol=1e-13)
        shared = x.dim() > 2  # positions share the weight: curvlinops' bias block is B
        if approx == "reduce" or not shared:
            torch.testing.assert_close(got[name_ + ".bias"][0], b, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_micro_batches_combine_as_one_batch(reduction):
    torch.manual_seed(0)
    model, lossfunc, x, y = _case("tagger", reduction, batch=6)
    y[:18][y[:18] == -100] = 1  # equal kept rows per half: "mean" halves weigh alike
    y[18:][y[18:] == -100] = 2
    whole = _factors(copy.deepcopy(model), lossfunc, x, y)
    model, lossfunc = curvopt.extend(model), curvopt.extend(lossfunc)
    weight = 0.5 if reduction == "mean" else 1.0  # gradient accumulation of two means
    with curvopt.collect(ext.KFACEmpirical()):
        for part in (slice(0, 3), slice(3, 6)):
            rows = slice(part.start * 6, part.stop * 6)
            (weight * lossfunc(model(x[part]), y[rows])).backward()
    for name, p in model.named_parameters():
        for got_f, want_f in zip(p.kfac_empirical, whole[name]):
            torch.testing.assert_close(got_f, want_f, rtol=1e-10, atol=1e-13)


class _Families(nn.Module):
    """The layer families with Kronecker factors (one-dimensional parameters: the exact block),
    and a weight tied between embedding and head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(6, 4)
        self.conv = nn.Conv1d(4, 4, 3, padding=1)
        self.norm = nn.LayerNorm(4)
        self.hf = Conv1D(4, 4)
        self.head = nn.Linear(4, 6)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        h = self.emb(idx).transpose(1, 2)
        h = torch.tanh(self.conv(h)).transpose(1, 2)
        h = self.norm(h)
        return self.head(torch.tanh(self.hf(h))).reshape(-1, 6)


@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_every_family_is_kfac_with_the_observed_labels(monkeypatch, approx, reduction):
    torch.manual_seed(0)
    model = _Families().to(DT)
    idx, y = torch.randint(0, 6, (3, 5)), torch.randint(0, 6, (15,))
    lossfunc = nn.CrossEntropyLoss(reduction=reduction)
    got = _factors(copy.deepcopy(model), lossfunc, idx, y, kfac_approx=approx)
    monkeypatch.setattr(cross_entropy, "_sample_classes", lambda probs, samples: y[:, None])
    model, lossfunc = curvopt.extend(model), curvopt.extend(lossfunc)
    with curvopt.collect(ext.KFAC(kfac_approx=approx)):
        lossfunc(model(idx), y).backward()
    for name, p in model.named_parameters():
        assert len(p.kfac) == len(got[name]) >= 1, name
        for got_f, want_f in zip(got[name], p.kfac):
            torch.testing.assert_close(got_f, want_f, rtol=1e-10, atol=1e-13)


def test_unsupported_layer_raises_naming_it():
    model = curvopt.extend(nn.Sequential(nn.Conv1d(2, 3, 3), nn.ConvTranspose1d(3, 2, 3)).to(DT))
    lossfunc = curvopt.extend(nn.MSELoss())
    x, y = torch.randn(2, 2, 5, dtype=DT), torch.randn(2, 2, 5, dtype=DT)
    with pytest.raises(UnsupportedKroneckerError, match="ConvTranspose1d"):
        with curvopt.collect(ext.KFACEmpirical()):
            lossfunc(model(x), y).backward()
    for p in model.parameters():
        assert not hasattr(p, "kfac_empirical")


def test_bad_approx_raises():
    with pytest.raises(ValueError, match="KFACEmpirical: kfac_approx"):
        ext.KFACEmpirical(kfac_approx="both")


@pytest.mark.filterwarnings("ignore:curvopt.collect\\(skip_unsupported")
def test_diagonal_fallback_is_the_empirical_fisher_diagonal():
    """``collect(skip_unsupported="diagonal")``: a weight without factors gets
    ``p.kfac_empirical_diagonal = c sum_n g_n**2`` (``MSELoss("mean")``: ``c = N K``)."""
    torch.manual_seed(0)
    model = curvopt.extend(
        nn.Sequential(nn.Conv1d(2, 3, 3), nn.Tanh(), nn.ConvTranspose1d(3, 2, 3))
    )
    model = model.to(DT)
    lossfunc = curvopt.extend(nn.MSELoss())
    x, y = torch.randn(4, 2, 5, dtype=DT), torch.randn(4, 2, 5, dtype=DT)
    plain = copy.deepcopy(model)
    weight = plain[2].weight
    want = sum(
        torch.autograd.grad(lossfunc(plain(x)[n : n + 1], y[n : n + 1]) / 4, weight)[0] ** 2
        for n in range(4)
    )
    with curvopt.collect(ext.KFACEmpirical(), skip_unsupported="diagonal"):
        lossfunc(model(x), y).backward()
    assert not hasattr(model[2].weight, "kfac_empirical")
    torch.testing.assert_close(model[2].weight.kfac_empirical_diagonal, y.numel() * want)
    assert len(model[0].weight.kfac_empirical) == 2
