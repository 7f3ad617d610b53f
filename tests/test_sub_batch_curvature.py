"""Kronecker factors from a sub-batch (``KFAC/KFLR/KFACEmpirical(samples=K)``, ``EKFAC``'s bases,
``optim.KFAC(curvature_samples=K)``), float64.

The definition (docs/conventions.md): the factors the same quantity gives on the first ``K``
samples alone, the output side scaled to estimate the whole batch's: ``N/K`` for
``reduction="sum"``, and for ``"mean"`` the sub-batch's own mean (its loss divides by its own
counted rows). The references: the dense Kronecker factors of ``tests/reference.py`` on
``X[:K]`` (weights), and curvopt's whole-batch factors on ``X[:K]`` alone (every parameter).
"""

import copy

import pytest
import torch
from conftest import DT, assert_close
from reference import kronecker
from torch import nn

import curvopt
from curvopt import extensions as ext

N = 6


def _mlp():
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).to(DT)


def _cnn():
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(3, 2, 2, padding=1),
        nn.Flatten(),
        nn.Linear(2 * 4 * 4, 3),
    ).to(DT)


class _Tagger(nn.Module):
    """A sequence model: embedding, a position-wise linear layer, logits flattened to rows."""

    def __init__(self):
        super().__init__()
        self.emb, self.mix, self.head = nn.Embedding(7, 4), nn.Linear(4, 4), nn.Linear(4, 5)

    def forward(self, idx):
        return self.head(torch.tanh(self.mix(self.emb(idx)))).reshape(-1, 5)


def _problem(kind, reduction):
    """``(plain model, X, y, loss module, loss_on for the reference)``."""
    torch.manual_seed(1)
    if kind == "seq":
        model, x = _Tagger().to(DT), torch.randint(0, 7, (N, 4))
        y = torch.randint(0, 5, (N * 4,))
        y[[1, 4, 5, 6, 7, 17]] = -100  # ignored rows, a whole sample (1: rows 4..7) among them
        y = y.reshape(N, 4)
        loss = nn.CrossEntropyLoss(reduction=reduction, ignore_index=-100)
        return model, x, y, loss, lambda out, t: loss(out, t.reshape(-1))
    model = _mlp() if kind == "mlp" else _cnn()
    x = torch.randn(N, 5, dtype=DT) if kind == "mlp" else torch.randn(N, 2, 6, 6, dtype=DT)
    y = torch.randint(0, 3, (N,))
    loss = nn.CrossEntropyLoss(reduction=reduction)
    return model, x, y, loss, loss


def _collect(model, loss, x, y, *exts):
    model = curvopt.extend(copy.deepcopy(model))
    lossfunc = curvopt.extend(copy.deepcopy(loss))
    target = y.reshape(-1) if isinstance(model, _Tagger) else y
    with curvopt.collect(*exts):
        lossfunc(model(x), target).backward()
    return model


def _factors(model, attr):
    return {name: [f.clone() for f in getattr(p, attr)] for name, p in model.named_parameters()}


def _scaled(factors, model, c):
    """``factors`` with the output side times ``c`` (the embedding's is its second)."""
    out = {}
    for name, fs in factors.items():
        side = 1 if name.startswith("emb") else 0
        out[name] = [f * c if i == side else f for i, f in enumerate(fs)]
    return out


@pytest.mark.parametrize("kind", ["mlp", "cnn", "seq"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize("k", [1, 3])
def test_kflr_of_the_first_samples(kind, reduction, approx, k):
    model, x, y, loss, loss_on = _problem(kind, reduction)
    sub = _collect(model, loss, x, y, ext.KFLR(kfac_approx=approx, samples=k))
    alone = _collect(model, loss, x[:k], y[:k], ext.KFLR(kfac_approx=approx))
    c = N / k if reduction == "sum" else 1.0
    if kind == "seq" and k == 1 and reduction == "mean":
        c = 1.0  # sample 0 has 3 counted rows; alone, it is its own mean
    expected = _scaled(_factors(alone, "kflr"), alone, c)
    for name, p in sub.named_parameters():
        for got, want in zip(p.kflr, expected[name]):
            assert_close(got, want, f"{kind} {name}")
    dense = kronecker(model, loss_on, x[:k], y[:k], approx=approx)
    for module, (b, a) in dense.items():
        got = sub.get_submodule(module).weight.kflr
        if module.startswith("emb"):  # [A (one-hot), B]
            b, a = a, b * c
            assert_close(got[0], b, module)
            assert_close(got[1], a, module)
        else:
            assert_close(got[0], b * c, module)
            assert_close(got[1], a, module)


def test_mean_scale_counts_the_sub_batch_rows():
    """``"mean"`` with ignored rows: the whole batch divides by its 18 counted rows, the first
    two samples by their 3 + 0 counted rows (sample 1 is ignored entirely)."""
    model, x, y, loss, _ = _problem("seq", "mean")
    whole = _collect(model, loss, x, y, ext.KFLR())
    sub = _collect(model, loss, x, y, ext.KFLR(samples=2))
    restricted = _collect(
        model, nn.CrossEntropyLoss(reduction="sum", ignore_index=-100), x, y, ext.KFLR(samples=2)
    )
    counted = int((y != -100).sum())
    assert counted == 18
    # the sum's sub-batch factor is N/K times the first samples' sum; the mean's is 1/3 of it
    for (name, p), q in zip(sub.named_parameters(), restricted.parameters()):
        side = 1 if name.startswith("emb") else 0
        assert_close(p.kflr[side], q.kflr[side] / (N / 2) / 3, name)
    assert not torch.equal(whole.head.weight.kflr[0], sub.head.weight.kflr[0])


def test_all_ignored_sub_batch_gives_zero_output_side():
    model, x, y, loss, _ = _problem("seq", "mean")
    y = y.clone()
    y[0] = -100
    sub = _collect(model, loss, x, y, ext.KFLR(samples=1))
    assert torch.count_nonzero(sub.head.weight.kflr[0]) == 0
    assert torch.isfinite(sub.head.weight.kflr[1]).all()


@pytest.mark.parametrize("kind", ["mlp", "cnn", "seq"])
@pytest.mark.parametrize("k", [N, N + 3])
def test_whole_batch_when_k_covers_it(kind, k):
    model, x, y, loss, _ = _problem(kind, "mean")
    torch.manual_seed(3)
    whole = _collect(model, loss, x, y, ext.KFAC(), ext.KFLR())
    torch.manual_seed(3)
    sub = _collect(model, loss, x, y, ext.KFAC(samples=k), ext.KFLR(samples=k))
    for p, q in zip(whole.parameters(), sub.parameters()):
        for attr in ("kfac", "kflr"):
            for a, b in zip(getattr(p, attr), getattr(q, attr)):
                assert torch.equal(a, b)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_kfac_draws_the_whole_batch_targets(reduction):
    """MC: the first ``K`` samples keep the targets a whole-batch draw of the same seed gives
    them, so the factors do not depend on the other samples' inputs."""
    model, x, y, loss, _ = _problem("cnn", reduction)
    other = torch.cat([x[:2], torch.randn_like(x[2:])])
    factors = []
    for inputs in (x, other):
        torch.manual_seed(5)
        factors.append(_factors(_collect(model, loss, inputs, y, ext.KFAC(samples=2)), "kfac"))
    for name in factors[0]:
        for a, b in zip(factors[0][name], factors[1][name]):
            assert_close(a, b, name)
    torch.manual_seed(5)
    whole = _factors(_collect(model, loss, x, y, ext.KFAC()), "kfac")
    assert not torch.allclose(whole["4.weight"][0], factors[0]["4.weight"][0])


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_kfac_empirical_of_the_first_samples(reduction):
    model, x, y, loss, _ = _problem("cnn", reduction)
    sub = _factors(_collect(model, loss, x, y, ext.KFACEmpirical(samples=2)), "kfac_empirical")
    alone = _collect(model, loss, x[:2], y[:2], ext.KFACEmpirical())
    expected = _scaled(_factors(alone, "kfac_empirical"), alone, N / 2 if reduction == "sum" else 1)
    for name in sub:
        for a, b in zip(sub[name], expected[name]):
            assert_close(a, b, name)


def test_micro_batches_combine_their_sub_batches():
    """Each micro-batch contributes the factors of its own first ``K`` samples (scaled to
    estimate that micro-batch's), combined as whole micro-batches' factors are: ``B`` adds,
    ``A`` averages with weights ``N_i`` (a micro-batch of at most ``K`` samples: all of it)."""
    model, x, y, loss, _ = _problem("mlp", "sum")
    parts = [(x[:4], y[:4]), (x[4:], y[4:])]  # 4 and 2 samples, K = 3
    extended = curvopt.extend(copy.deepcopy(model))
    lossfunc = curvopt.extend(copy.deepcopy(loss))
    with curvopt.collect(ext.KFLR(samples=3)):
        for xi, yi in parts:
            lossfunc(extended(xi), yi).backward()
    first = _collect(model, loss, x[:3], y[:3], ext.KFLR())
    second = _collect(model, loss, x[4:], y[4:], ext.KFLR())
    for name, p in extended.named_parameters():
        b = first.get_parameter(name).kflr[0] * 4 / 3 + second.get_parameter(name).kflr[0]
        assert_close(p.kflr[0], b, name)
        if p.dim() > 1:
            a = (first.get_parameter(name).kflr[1] * 4 + second.get_parameter(name).kflr[1] * 2) / 6
            assert_close(p.kflr[1], a, name)


def test_ekfac_bases_from_the_sub_batch():
    model, x, y, loss, _ = _problem("mlp", "mean")
    torch.manual_seed(2)
    sub = _collect(model, loss, x, y, ext.EKFAC(factors="kflr", samples=2))
    alone = _collect(model, loss, x[:2], y[:2], ext.KFLR())
    torch.manual_seed(2)
    supplied = {p: list(p.ekfac[1:]) for p in sub.parameters()}
    full = curvopt.extend(copy.deepcopy(model))
    lossfunc = curvopt.extend(copy.deepcopy(loss))
    params = dict(zip(full.parameters(), sub.parameters()))
    bases = {q: supplied[params[q]] for q in full.parameters()}
    with curvopt.collect(ext.EKFAC(factors="kflr", bases=bases)):
        lossfunc(full(x), y).backward()
    for (name, p), q, r in zip(sub.named_parameters(), alone.parameters(), full.parameters()):
        for basis, factor in zip(p.ekfac[1:], q.kflr):
            rotated = basis.T @ factor @ basis  # the sub-batch factor is diagonal in its basis
            assert_close(rotated, torch.diag(torch.diagonal(rotated)), name)
        assert_close(p.ekfac[0], r.ekfac[0], name)  # S of the whole batch


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "4"])
def test_bad_samples_raise(bad):
    with pytest.raises(ValueError, match="KFAC: samples must be a positive int"):
        ext.KFAC(samples=bad)
    with pytest.raises(ValueError, match="curvature_samples must be an int"):
        curvopt.optim.KFAC(_mlp().parameters(), lr=0.1, damping=0.1, curvature_samples=bad)


@pytest.mark.parametrize(
    "make", [ext.DiagGGNExact, ext.DiagGGNMC, ext.BatchDiagGGNMC, ext.DiagHessian, ext.KFRA]
)
def test_quantities_without_sub_batches_raise(make):
    with pytest.raises(ValueError, match=f"{make.__name__}: samples= .* Kronecker factors only"):
        make(samples=2)


def test_optimizers_without_sub_batches_raise_at_construction():
    params = list(_mlp().parameters())
    with pytest.raises(ValueError, match="KFRA: samples="):
        curvopt.optim.KFAC(params, lr=0.1, damping=0.1, curvature="kfra", curvature_samples=2)
    with pytest.raises(ValueError, match="DiagGGNMC: samples="):
        curvopt.optim.DiagGGNNewton(params, lr=0.1, damping=0.1, curvature_samples=2)


def _optimizer(net, **options):
    return curvopt.optim.KFAC(
        net.parameters(), lr=0.1, damping=0.1, curvature="kflr", kl_clip=None, **options
    )


def test_optimizer_steps_with_the_sub_batch_factors():
    """``KFAC(curvature_samples=K)`` takes the step of the whole batch's gradient
    preconditioned by the factors of its first ``K`` samples alone (``"mean"``: their mean):
    the same step as an optimizer given those factors by an explicit collection on ``X[:K]``
    and the whole batch's gradient by hand."""
    model, x, y, loss, _ = _problem("cnn", "mean")
    lossfunc = curvopt.extend(copy.deepcopy(loss))
    net = curvopt.extend(copy.deepcopy(model))
    opt = _optimizer(net, curvature_samples=2)
    lossfunc(net(x), y).backward()
    grads = [p.grad.clone() for p in net.parameters()]
    opt.step()
    ref = curvopt.extend(copy.deepcopy(model))
    ref_opt = _optimizer(ref, collection="explicit")
    with ref_opt.collect():
        lossfunc(ref(x[:2]), y[:2]).backward()
    for p, g in zip(ref.parameters(), grads):
        p.grad = g.clone()
    ref_opt.step()
    moved = 0.0
    for p, q, m in zip(net.parameters(), ref.parameters(), model.parameters()):
        assert_close(p.detach(), q.detach())
        moved += float((p - m).detach().abs().sum())
    assert moved > 0
    whole = curvopt.extend(copy.deepcopy(model))
    whole_opt = _optimizer(whole)
    lossfunc(whole(x), y).backward()
    whole_opt.step()
    assert not torch.allclose(whole[0].weight, net[0].weight)


@pytest.mark.parametrize("make", ["KFAC", "EKFAC"])
def test_kfac_family_options_reach_the_collection(make):
    model, x, y, loss, _ = _problem("cnn", "sum")
    net = curvopt.extend(copy.deepcopy(model))
    cls = getattr(curvopt.optim, make)
    opt = cls(net.parameters(), lr=0.01, damping=1.0, curvature_samples=2)
    assert opt.param_groups[0]["curvature_samples"] == 2
    wanted, _ = opt._requests()  # EKFAC: also the factors of its next bases
    assert wanted and all(w.options["samples"] == 2 for w in wanted)
    curvopt.extend(copy.deepcopy(loss))(net(x), y).backward()
    opt.step()
    assert all(torch.isfinite(p).all() for p in net.parameters())


class _Mixing(nn.Module):
    """Samples mixed between the layers (``h - h.mean(0)``): no row layout exists."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(5, 4), nn.Linear(4, 3)

    def forward(self, x):
        h = self.first(x)
        return self.second(h - h.mean(0))


def test_the_row_layout_probes_still_run():
    model, x, y, loss = (
        _Mixing().to(DT),
        torch.randn(N, 5, dtype=DT),
        torch.randint(0, 3, (N,)),
        nn.CrossEntropyLoss(),
    )
    with pytest.raises(curvopt.errors.UnsupportedModuleError, match="which of the 6 samples"):
        _collect(model, loss, x, y, ext.KFAC(samples=2))


class _SequenceFirst(nn.Module):
    """``[T, N, I]`` inputs, rows ``[T N, C]``: the loss rows of sample ``n`` are ``r % N``."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 5)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))).reshape(-1, 5)


def _layouts(case):
    """``(model, extend options, X, y, loss, the first k samples of (X, y))``."""
    torch.manual_seed(2)
    if case == "sequence_first":
        x, y = torch.randn(3, N, 3, dtype=DT), torch.randint(0, 5, (3, N))
        y[0, 0] = -100
        loss = nn.CrossEntropyLoss(ignore_index=-100)
        return (
            _SequenceFirst().to(DT),
            {"sequence_first": True},
            x,
            y.reshape(-1),
            loss,
            lambda k: (x[:, :k], y[:, :k].reshape(-1)),
        )
    if case == "k_dim":  # [N, C, T] logits, [N, T] targets
        x, y = torch.randn(N, 2, 6, dtype=DT), torch.randint(0, 4, (N, 6))
        y[0, :2] = -100
        loss = nn.CrossEntropyLoss(ignore_index=-100)
        return nn.Conv1d(2, 4, 3, padding=1).to(DT), {}, x, y, loss, lambda k: (x[:k], y[:k])
    x, y = torch.randn(N, 3, dtype=DT), torch.randn(N, 2, 4, dtype=DT)  # MSE, K outputs
    model = nn.Sequential(nn.Linear(3, 8), nn.Unflatten(1, (2, 4))).to(DT)
    return model, {}, x, y, nn.MSELoss(), lambda k: (x[:k], y[:k])


@pytest.mark.parametrize("case", ["sequence_first", "k_dim", "mse"])
def test_row_layouts_and_losses(case):
    model, options, x, y, loss, first = _layouts(case)
    results = []
    for inputs, target, exts in ((x, y, ext.KFLR(samples=2)), (*first(2), ext.KFLR())):
        net = curvopt.extend(copy.deepcopy(model), **options)
        lossfunc = curvopt.extend(copy.deepcopy(loss))
        with curvopt.collect(exts):
            lossfunc(net(inputs), target).backward()
        results.append([list(p.kflr) for p in net.parameters()])
    for got, want in zip(*results):
        for a, b in zip(got, want):
            assert_close(a, b, case)
