"""``extensions.EKFAC``: ``p.ekfac = [S, *bases]`` with ``S = c · Σ_n (Q_0ᵀ G_n Q_1)²``, against a
brute force in float64: per-sample gradients from a loop over samples (each sample's forward
with its own copy of the parameters, the loss on all outputs as the model computes it),
rotated by the same bases (the eigenvectors of the ``kfac``/``kflr`` factors of a pass with the
same seed, or supplied orthogonal matrices)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.func import functional_call

import curvopt
from curvopt import extensions as ext
from fixtures import zoo
from curvopt.errors import AccumulationError, UnsupportedKroneckerError, UnsupportedLossError
from curvopt.layers.linear import LinearRule
from curvopt.core.psd import psd_eigh
from conftest import Conv1D

DT = torch.float64


class Sequence(nn.Module):
    """``[N, T, D]`` through Linear, LayerNorm, Conv1D: logits ``[N, T, C]``."""

    def __init__(self, d=4, c=3):
        super().__init__()
        self.inp = nn.Linear(d, 5)
        self.norm = nn.LayerNorm(5)
        self.out = Conv1D(c, 5)

    def forward(self, x):
        return self.out(torch.tanh(self.norm(self.inp(x))))


class Tokens(nn.Module):
    def __init__(self, vocab=6, c=3):
        super().__init__()
        self.emb = nn.Embedding(vocab, 4, padding_idx=0)
        self.out = nn.Linear(4, c)

    def forward(self, idx):
        return self.out(torch.tanh(self.emb(idx)))


class _Transpose(nn.Module):
    def forward(self, x):
        return x.transpose(1, 2)


class Reused(nn.Module):
    """One Linear applied twice: its weight is used by two calls."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.lin(torch.tanh(self.lin(x)))))


def _flat(lossfunc):
    return lambda out, y: lossfunc(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _plain(lossfunc):
    return lossfunc


def _images(shape):
    return lambda g, n: (
        torch.randn(n, *shape, generator=g, dtype=DT),
        torch.randint(0, 3, (n,), generator=g),
    )


def _sequence(g, n):
    y = torch.randint(0, 3, (n, 5), generator=g)
    y[0, 1] = -100  # ignore_index
    return torch.randn(n, 5, 4, generator=g, dtype=DT), y


def _tokens(g, n):
    return torch.randint(0, 6, (n, 5), generator=g), torch.randint(0, 3, (n, 5), generator=g)


MODELS = {
    "mlp": (
        lambda: nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 3)),
        _images((3,)),
        _plain,
    ),
    "cnn": (
        lambda: nn.Sequential(
            nn.Conv2d(2, 3, 3, stride=2, padding=1, dilation=2),
            nn.Sigmoid(),
            nn.Conv2d(3, 2, 2, padding=1),
            nn.Flatten(),
            nn.Linear(18, 3),
        ),
        _images((2, 5, 5)),
        _plain,
    ),
    "conv1d_3d": (
        lambda: nn.Sequential(
            nn.Conv1d(2, 3, 2, stride=2, dilation=1),
            nn.Tanh(),
            nn.Unflatten(1, (3, 1)),
            nn.Unflatten(3, (1, 3)),
            nn.Conv3d(3, 2, (1, 1, 2)),
            nn.Flatten(),
            nn.Linear(4, 3),
        ),
        _images((2, 6)),
        _plain,
    ),
    "sequence": (Sequence, _sequence, _flat),
    # positions fewer than the channels: the rotated operands' path (layers.eigenbasis)
    "wide": (
        lambda: nn.Sequential(
            nn.Conv2d(6, 8, 2),
            nn.Tanh(),
            nn.Flatten(2),
            _Transpose(),
            nn.Linear(8, 10),
            nn.Flatten(),
            nn.Linear(40, 3),
        ),
        _images((6, 3, 3)),
        _plain,
    ),
    "embedding": (Tokens, _tokens, _flat),
    "reused": (Reused, _images((4,)), _plain),
}


def _problem(name, n, reduction, models=MODELS):
    build, batch, layout = models[name]
    torch.manual_seed(0)
    model = build().to(DT)
    x, y = batch(torch.Generator().manual_seed(1), n)
    return model, nn.CrossEntropyLoss(reduction=reduction), layout, x, y


def _per_sample_grads(model, loss_of, x, y):
    """``{name: [N, *p.shape]}``: each sample's forward with its own copy of the parameters,
    the loss on all outputs together, differentiated w.r.t. the copies."""
    names = [k for k, _ in model.named_parameters()]
    n = x.shape[0]
    copies = [
        p.detach().unsqueeze(0).repeat(n, *[1] * p.dim()).requires_grad_()
        for _, p in model.named_parameters()
    ]
    outs = [
        functional_call(model, {k: c[i] for k, c in zip(names, copies)}, (x[i : i + 1],))
        for i in range(n)
    ]
    grads = torch.autograd.grad(loss_of(torch.cat(outs), y), copies)
    return dict(zip(names, grads))


def _divisor(reduction, y):
    """The cross-entropy's divisor ``D``: its counted (non-ignored) target rows for "mean"."""
    return int((y != -100).sum()) if reduction == "mean" else 1


def _moment(grads, bases, scale):
    """``scale · Σ_n (Q_0ᵀ G_n Q_1)²`` by explicit products over samples."""
    rows = bases[0].shape[0] if bases else 1
    total = 0
    for g in grads:
        m = g.reshape(rows, -1)
        if bases:
            m = bases[0].T @ m
        if len(bases) == 2:
            m = m @ bases[1]
        total = total + m**2
    return scale * total


def _collect(model, lossfunc, layout, x, y, *extensions, seed=3):
    torch.manual_seed(seed)
    model.zero_grad()
    with curvopt.collect(*extensions):
        layout(lossfunc)(model(x), y).backward()


def _orthogonal(size, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(size, size, generator=g, dtype=DT))[0]


def _random_bases(model):
    bases = {}
    for i, p in enumerate(model.parameters()):
        sizes = [p.shape[0], p[0].numel()] if p.dim() > 1 else [p.shape[0]]
        bases[p] = [_orthogonal(s, 10 * i + j) for j, s in enumerate(sizes)]
    return bases


FRESH = ["mlp", "cnn", "conv1d_3d", "sequence", "wide", "embedding", "reused"]


@pytest.mark.parametrize("factors", ["kfac", "kflr"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("name", FRESH)
def test_fresh_bases_are_the_factors_eigenvectors_and_s_the_rotated_second_moment(
    name, n, reduction, factors
):
    model, lossfunc, layout, x, y = _problem(name, n, reduction)
    grads = _per_sample_grads(model, layout(lossfunc), x, y)
    model, lossfunc = curvopt.extend(model), curvopt.extend(lossfunc)
    _collect(model, lossfunc, layout, x, y, ext.EKFAC(factors=factors))
    written = {k: p.ekfac for k, p in model.named_parameters()}
    kron = ext.KFAC() if factors == "kfac" else ext.KFLR()
    _collect(model, lossfunc, layout, x, y, kron)  # the same seed: the same sampled columns
    scale = _divisor(reduction, y)
    for k, p in model.named_parameters():
        S, *bases = written[k]
        expected_bases = [psd_eigh(f)[1] for f in getattr(p, kron.attr)]
        assert len(bases) == len(expected_bases) == min(p.dim(), 2)
        for q, expected in zip(bases, expected_bases):
            torch.testing.assert_close(q, expected, rtol=0, atol=0)
        reference = _moment(grads[k], expected_bases, scale)
        assert S.shape == reference.shape
        torch.testing.assert_close(S, reference, rtol=1e-10, atol=1e-13), k


#: layers without Kronecker factors: S in supplied bases only
SUPPLIED_ONLY = {
    "grouped": (
        lambda: nn.Sequential(nn.Conv2d(4, 4, 2, groups=2), nn.Flatten(), nn.Linear(16, 3)),
        _images((4, 3, 3)),
        _plain,
    ),
    "transposed": (
        lambda: nn.Sequential(
            nn.ConvTranspose2d(2, 3, 2, stride=2), nn.Tanh(), nn.Flatten(), nn.Linear(48, 3)
        ),
        _images((2, 2, 2)),
        _plain,
    ),
}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", list(MODELS) + list(SUPPLIED_ONLY))
def test_supplied_bases_give_s_in_that_basis_without_any_factors(name, reduction, monkeypatch):
    model, lossfunc, layout, x, y = _problem(name, 3, reduction, {**MODELS, **SUPPLIED_ONLY})
    grads = _per_sample_grads(model, layout(lossfunc), x, y)
    model, lossfunc = curvopt.extend(model), curvopt.extend(lossfunc)
    bases = _random_bases(model)

    def no_factors(*args, **kwargs):
        raise AssertionError("supplied bases need no Kronecker factors")

    monkeypatch.setattr("curvopt.engine.kron_pass.kron_factors", no_factors)
    _collect(model, lossfunc, layout, x, y, ext.EKFAC(bases=bases))
    scale = _divisor(reduction, y)
    for k, p in model.named_parameters():
        S, *written = p.ekfac
        assert all(a is b for a, b in zip(written, bases[p])) and len(written) == len(bases[p])
        torch.testing.assert_close(S, _moment(grads[k], bases[p], scale), rtol=1e-10, atol=1e-13)


def test_a_callable_and_partial_bases_mix_supplied_and_fresh():
    model, lossfunc, layout, x, y = _problem("mlp", 5, "mean")
    grads = _per_sample_grads(model, layout(lossfunc), x, y)
    model, lossfunc = curvopt.extend(model), curvopt.extend(lossfunc)
    first = model[0].weight
    supplied = _random_bases(model)[first]
    _collect(
        model, lossfunc, layout, x, y, ext.EKFAC(bases=lambda p: supplied if p is first else None)
    )
    ekfac = {k: p.ekfac for k, p in model.named_parameters()}
    _collect(model, lossfunc, layout, x, y, ext.KFAC())
    for k, p in model.named_parameters():
        bases = supplied if p is first else [psd_eigh(f)[1] for f in p.kfac]
        torch.testing.assert_close(ekfac[k][0], _moment(grads[k], bases, 5), rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("name", ["mlp", "sequence", "wide"])
def test_dense_layers_never_materialise_per_sample_weight_gradients(name, monkeypatch):
    """``batch_grad`` (``[N, *p.shape]``) is never called for a ``Linear`` weight: ``P = 1``
    forms no per-sample gradient, ``P > 1`` one chunk of samples at a time (here one sample:
    the chunking is exercised)."""
    monkeypatch.setattr("curvopt.layers.eigenbasis.CHUNK_ELEMENTS", 1)
    monkeypatch.setattr("curvopt.layers.registry.CHUNK_ELEMENTS", 1)
    model, lossfunc, layout, x, y = _problem(name, 4, "mean")
    grads = _per_sample_grads(model, layout(lossfunc), x, y)
    model, lossfunc = curvopt.extend(model), curvopt.extend(lossfunc)
    original = LinearRule.batch_grad

    def guarded(self, call, name, out=None):
        if name == "weight":
            raise AssertionError("per-sample weight gradients materialised")
        return original(self, call, name, out)

    monkeypatch.setattr(LinearRule, "batch_grad", guarded)
    _collect(model, lossfunc, layout, x, y, ext.EKFAC())
    monkeypatch.setattr(LinearRule, "batch_grad", original)
    ekfac = {k: p.ekfac for k, p in model.named_parameters()}
    _collect(model, lossfunc, layout, x, y, ext.KFAC())
    for k, p in model.named_parameters():
        bases = [psd_eigh(f)[1] for f in p.kfac]
        expected = _moment(grads[k], bases, _divisor("mean", y))
        torch.testing.assert_close(ekfac[k][0], expected, rtol=1e-10, atol=1e-13)


def test_the_guard_of_the_dense_path_does_fire_through_batch_grad(monkeypatch):
    """The guard above is live: the same model with BatchGrad raises through it."""
    model, lossfunc, layout, x, y = _problem("mlp", 4, "mean")
    model, lossfunc = curvopt.extend(model), curvopt.extend(lossfunc)

    def guarded(self, call, name, out=None):
        raise AssertionError("per-sample weight gradients materialised")

    monkeypatch.setattr(LinearRule, "batch_grad", guarded)
    with pytest.raises(AssertionError, match="materialised"):
        _collect(model, lossfunc, layout, x, y, ext.EKFAC(), ext.BatchGrad())


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_micro_batches_with_supplied_bases_add_each_pass_s(reduction):
    """Like ``diag_ggn`` and ``kfac``'s ``B``, ``S`` is that of the objective the passes sum
    to: each pass scaled by its own ``c`` (its divisor ``D_i`` for "mean"), then added."""
    model, lossfunc, layout, x, y = _problem("cnn", 5, reduction)
    parts = [(x[:2], y[:2]), (x[2:], y[2:])]
    grads = [_per_sample_grads(model, lossfunc, xi, yi) for xi, yi in parts]
    model, lossfunc = curvopt.extend(model), curvopt.extend(lossfunc)
    bases = _random_bases(model)
    model.zero_grad()
    with curvopt.collect(ext.EKFAC(bases=bases)):
        for xi, yi in parts:
            lossfunc(model(xi), yi).backward()
    for k, p in model.named_parameters():
        expected = sum(
            _moment(g[k], bases[p], _divisor(reduction, yi)) for g, (_, yi) in zip(grads, parts)
        )
        torch.testing.assert_close(p.ekfac[0], expected, rtol=1e-10, atol=1e-13)


def test_micro_batches_with_fresh_bases_raise():
    model, lossfunc, layout, x, y = _problem("mlp", 4, "mean")
    model, lossfunc = curvopt.extend(model), curvopt.extend(lossfunc)
    with pytest.raises(AccumulationError, match="different eigenbases"):
        with curvopt.collect(ext.EKFAC()):
            for i in (0, 2):
                lossfunc(model(x[i : i + 2]), y[i : i + 2]).backward()


def test_with_batch_grad_s_comes_from_the_materialised_gradients_alike():
    model, lossfunc, layout, x, y = _problem("sequence", 3, "sum")
    grads = _per_sample_grads(model, layout(lossfunc), x, y)
    model, lossfunc = curvopt.extend(model), curvopt.extend(lossfunc)
    bases = _random_bases(model)
    _collect(model, lossfunc, layout, x, y, ext.EKFAC(bases=bases), ext.BatchGrad())
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad_batch, grads[k], rtol=1e-10, atol=1e-13)
        torch.testing.assert_close(
            p.ekfac[0], _moment(grads[k], bases[p], 1), rtol=1e-10, atol=1e-13
        )


def test_a_weight_without_factors_with_fresh_bases_raises_naming_the_module():
    model = curvopt.extend(nn.Sequential(nn.ConvTranspose2d(4, 4, 2), nn.Flatten()).to(DT))
    lossfunc = curvopt.extend(nn.MSELoss())
    x = torch.randn(2, 4, 3, 3, dtype=DT)
    with pytest.raises(UnsupportedKroneckerError, match=r"'0' \(ConvTranspose2d\)"):
        with curvopt.collect(ext.EKFAC()):
            lossfunc(model(x), torch.zeros(2, 64, dtype=DT)).backward()
    assert not hasattr(model[0].weight, "ekfac")


def test_two_losses_in_one_pass_raise():
    model, lossfunc, layout, x, y = _problem("mlp", 4, "mean")
    model, lossfunc = curvopt.extend(model), curvopt.extend(lossfunc)
    other = curvopt.extend(nn.CrossEntropyLoss(reduction="sum"))
    out = model(x)
    with pytest.raises(UnsupportedLossError, match="two extended losses"):
        with curvopt.collect(ext.EKFAC()):
            (lossfunc(out, y) + other(out, y)).backward()
    assert not hasattr(model[0].weight, "ekfac")


@pytest.mark.parametrize(
    "bad", [lambda p: [torch.eye(p.shape[0] + 1, dtype=DT)], lambda p: [torch.eye(p.shape[0])] * 3]
)
def test_supplied_bases_of_the_wrong_shape_raise_naming_the_parameter(bad):
    model, lossfunc, layout, x, y = _problem("mlp", 4, "mean")
    model, lossfunc = curvopt.extend(model), curvopt.extend(lossfunc)
    with pytest.raises(ValueError, match="bases supplied for parameter"):
        _collect(model, lossfunc, layout, x, y, ext.EKFAC(bases=lambda p: bad(p).copy()))


def test_identity_bases_give_the_diagonal_empirical_fisher():
    model, lossfunc, layout, x, y = _problem("mlp", 4, "sum")
    grads = _per_sample_grads(model, layout(lossfunc), x, y)
    model, lossfunc = curvopt.extend(model), curvopt.extend(lossfunc)
    _collect(model, lossfunc, layout, x, y, ext.EKFAC(bases=lambda p: []))
    for k, p in model.named_parameters():
        assert p.ekfac[0].shape == (1, p.numel())
        torch.testing.assert_close(
            p.ekfac[0].reshape(p.shape), (grads[k] ** 2).sum(0), rtol=1e-10, atol=1e-13
        )


def test_invalid_options_raise():
    with pytest.raises(ValueError, match="factors"):
        ext.EKFAC(factors="kfra")
    with pytest.raises(TypeError, match="bases"):
        ext.EKFAC(bases=[torch.eye(2)])
    with pytest.raises(ValueError, match="mc_samples"):
        ext.EKFAC(mc_samples=0)


def test_a_non_finite_factor_raises_naming_the_parameter_and_writes_nothing():
    model, lossfunc, layout, x, y = _problem("mlp", 4, "sum")
    model, lossfunc = curvopt.extend(model), curvopt.extend(lossfunc)
    x = x.clone()
    x[0, 0] = 1e200  # x xᵀ overflows; the gradients stay finite where the tanh saturates
    with pytest.raises(FloatingPointError, match=r"factor 1 of parameter '0.weight'"):
        _collect(model, lossfunc, layout, x, y, ext.EKFAC(factors="kflr"))
    assert not hasattr(model[0].weight, "ekfac")


def test_skip_unsupported_leaves_out_only_the_layers_without_factors():
    torch.manual_seed(0)
    model = nn.Sequential(nn.ConvTranspose2d(4, 4, 2), nn.Flatten(), nn.Linear(64, 3)).to(DT)
    x, y = _images((4, 3, 3))(torch.Generator().manual_seed(1), 3)
    grads = _per_sample_grads(model, nn.CrossEntropyLoss(), x, y)
    model, lossfunc = curvopt.extend(model), curvopt.extend(nn.CrossEntropyLoss())
    written = {}
    for extension in (ext.EKFAC(), ext.KFAC()):
        torch.manual_seed(3)
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            with curvopt.collect(extension, skip_unsupported=True) as collecting:
                lossfunc(model(x), y).backward()
        assert list(collecting.skipped) == ["0.weight"]
        written[extension.attr] = {
            k: getattr(p, extension.attr, None) for k, p in model.named_parameters()
        }
    assert written["ekfac"]["0.weight"] is None
    for k, _ in model.named_parameters():
        if k != "0.weight":
            bases = [psd_eigh(f)[1] for f in written["kfac"][k]]
            torch.testing.assert_close(
                written["ekfac"][k][0], _moment(grads[k], bases, 3), rtol=1e-10, atol=1e-13
            )


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", ["gpt", "bert", "resnet_block"])
def test_zoo_models_in_supplied_and_fresh_bases(name, reduction):
    """Attention, position embeddings of a shared ``arange`` (broadcast), tied weights,
    LayerNorm, residual convolutions: against the loop over samples."""
    problem = getattr(zoo, name)(reduction=reduction)
    x, y = problem.make_batch(3, 0)
    grads = _per_sample_grads(problem.model, problem.loss_on, x, y)
    model = curvopt.extend(problem.model)
    curvopt.extend(problem.lossfunc)  # the loss that loss_of calls
    scale = _divisor(reduction, y)
    bases = _random_bases(model)
    model.zero_grad()
    with curvopt.collect(ext.EKFAC(bases=bases)):
        problem.loss_of(model, x, y).backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(
            p.ekfac[0], _moment(grads[k], bases[p], scale), rtol=1e-10, atol=1e-13
        )
    written = {}
    for extension in (ext.EKFAC(), ext.KFAC()):
        torch.manual_seed(3)
        model.zero_grad()
        with curvopt.collect(extension):
            problem.loss_of(model, x, y).backward()
        written[extension.attr] = {
            k: getattr(p, extension.attr) for k, p in model.named_parameters()
        }
    for k, _ in model.named_parameters():
        fresh = [psd_eigh(f)[1] for f in written["kfac"][k]]
        S, *basis = written["ekfac"][k]
        assert all(torch.equal(a, b) for a, b in zip(basis, fresh)) and len(basis) == len(fresh)
        torch.testing.assert_close(S, _moment(grads[k], fresh, scale), rtol=1e-10, atol=1e-13)
