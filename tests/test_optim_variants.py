"""KFAC and EKFAC with ``kfac_approx="reduce"``: each step against a dense float64 reference
built from the factors ``collect`` writes with the same option (``kron(B, A)`` damped by the
trace-norm rule and solved densely), on a convolutional net whose factors differ in scale."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import curvopt
from curvopt import extensions as ext
from curvopt.optim import EKFAC, KFAC

DT = torch.float64
LAMBDA = 0.05


def conv_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Conv2d(3, 4, 2, stride=2), nn.Flatten(), nn.Linear(36, 3)
    ).to(DT)


def batch(seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    # inputs 20x larger than the outputs' scale: the trace-norm split pi is far from 1
    return 20 * torch.randn(5, 2, 9, 9, generator=gen, dtype=DT), torch.randint(
        0, 3, (5,), generator=gen
    )


def trace_norm_reference(factors, grad: torch.Tensor, damping: float) -> torch.Tensor:
    """``(kron(B + sqrt(l)/pi I, A + pi sqrt(l) I))^-1 vec(g)`` formed and solved densely."""
    if len(factors) == 1:
        (b,) = factors
        return torch.linalg.solve(b + damping * torch.eye(len(b), dtype=DT), grad.flatten())
    b, a = factors
    pi = ((a.trace() / len(a)) / (b.trace() / len(b))).sqrt()
    root = damping**0.5
    damped = torch.kron(
        b + root / pi * torch.eye(len(b), dtype=DT), a + pi * root * torch.eye(len(a), dtype=DT)
    )
    return torch.linalg.solve(damped, grad.flatten())


def collected(model, lossfunc, extension, seed=3):
    """``(grads, quantities)`` of one pass inside ``collect(extension)`` on a copy of ``model``."""
    model = curvopt.extend(copy.deepcopy(model))
    x, y = batch()
    torch.manual_seed(seed)
    with curvopt.collect(extension):
        lossfunc(model(x), y).backward()
    attr = extension.quantity.attr
    return [p.grad.clone() for p in model.parameters()], [
        [f.clone() for f in getattr(p, attr)] for p in model.parameters()
    ]


def optimizer_step(model, lossfunc, opt, seed=3):
    x, y = batch()
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    torch.manual_seed(seed)
    lossfunc(model(x), y).backward()
    opt.step()
    return [b - p.detach() for b, p in zip(before, model.parameters())]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("curvature", ["kflr", "kfac"])
def test_kfac_reduce_step_equals_dense_reference(curvature, reduction):
    model = curvopt.extend(conv_net())
    lossfunc = curvopt.extend(nn.CrossEntropyLoss(reduction=reduction))
    make = ext.KFLR if curvature == "kflr" else ext.KFAC
    grads, factors = collected(model, lossfunc, make(kfac_approx="reduce"))
    _, expanded = collected(model, lossfunc, make(kfac_approx="expand"))
    opt = KFAC(model.parameters(), 1.0, LAMBDA, curvature, kfac_approx="reduce", kl_clip=None)
    steps = optimizer_step(model, lossfunc, opt)
    b, a = factors[0]
    pi = ((a.trace() / len(a)) / (b.trace() / len(b))).sqrt()
    assert not 1 / 3 < float(pi) < 3  # a swapped damping split would show
    # reduce and expand differ on the convolutions (so the test tells them apart)
    assert not torch.allclose(factors[0][1], expanded[0][1], rtol=1e-3)
    for step, grad, fs in zip(steps, grads, factors):
        torch.testing.assert_close(step.flatten(), trace_norm_reference(fs, grad, LAMBDA))


def test_ekfac_reduce_step_equals_dense_reference():
    model = curvopt.extend(conv_net())
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    grads, ekfac = collected(model, lossfunc, ext.EKFAC(factors="kflr", kfac_approx="reduce"))
    _, expanded = collected(model, lossfunc, ext.EKFAC(factors="kflr"))
    opt = EKFAC(  # the paper's update: the basis of this step's own (reduce) factors
        model.parameters(),
        1.0,
        LAMBDA,
        "kflr",
        kfac_approx="reduce",
        kl_clip=None,
        basis_source="current",
    )
    steps = optimizer_step(model, lossfunc, opt)
    assert not torch.allclose(ekfac[0][0], expanded[0][0], rtol=1e-3)
    for step, grad, (s, *bases) in zip(steps, grads, ekfac):
        q = bases[0] if len(bases) == 1 else torch.kron(*bases)
        curvature = q @ torch.diag(s.flatten()) @ q.T
        expected = torch.linalg.solve(
            curvature + LAMBDA * torch.eye(len(q), dtype=DT), grad.flatten()
        )
        torch.testing.assert_close(step.flatten(), expected)


def test_kfac_approx_is_validated_at_construction():
    params = list(conv_net().parameters())
    with pytest.raises(
        ValueError, match="kfac_approx='reduce' does not exist for curvature='kfra'"
    ):
        KFAC(params, 0.1, 0.1, "kfra", kfac_approx="reduce")
    with pytest.raises(ValueError, match="kfac_approx must be one of"):
        KFAC(params, 0.1, 0.1, kfac_approx="mean")
    with pytest.raises(ValueError, match="kfac_approx must be one of"):
        EKFAC(params, 0.1, 0.1, kfac_approx="sum")
    assert KFAC(params, 0.1, 0.1, "kfra").param_groups[0]["kfac_approx"] == "expand"


# ----------------------------------------------------------------- trace-norm in the eigenbasis


def capped_reference(factor: torch.Tensor, k: int) -> torch.Tensor:
    """The best rank-``k`` approximation of a PSD ``factor`` (its top ``k`` eigenpairs)."""
    values, vectors = torch.linalg.eigh(factor)
    return vectors[:, -k:] @ torch.diag(values[-k:]) @ vectors[:, -k:].T


def capped_trace_norm_reference(factors, grad, damping, k):
    """As :func:`trace_norm_reference` with each factor wider than ``2k`` replaced by its
    rank-``k`` part, the shifts still from the full traces."""
    if len(factors) == 1:
        return trace_norm_reference(factors, grad, damping)
    b, a = factors
    pi = ((a.trace() / len(a)) / (b.trace() / len(b))).sqrt()
    root = damping**0.5
    b, a = (capped_reference(f, k) if len(f) > 2 * k else f for f in (b, a))
    damped = torch.kron(
        b + root / pi * torch.eye(len(b), dtype=DT), a + pi * root * torch.eye(len(a), dtype=DT)
    )
    return torch.linalg.solve(damped, grad.flatten())


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("kfac_approx", ["expand", "reduce"])
def test_trace_norm_eigh_step_equals_dense_reference(kfac_approx, reduction):
    """Dense factors (the convolutions') and a Gram root (the Linear's input side: 5 samples,
    36 inputs) alike: the trace-norm split of the decomposed factors, to rounding."""
    model = curvopt.extend(conv_net())
    lossfunc = curvopt.extend(nn.CrossEntropyLoss(reduction=reduction))
    grads, factors = collected(model, lossfunc, ext.KFLR(kfac_approx=kfac_approx))
    opt = KFAC(
        model.parameters(),
        1.0,
        LAMBDA,
        "kflr",
        kronecker_damping="trace_norm_eigh",
        kfac_approx=kfac_approx,
        kl_clip=None,
    )
    steps = optimizer_step(model, lossfunc, opt)
    linear = opt.state[model[4].weight]["trace_norm_eigh"]["value"]
    assert linear[1][1].shape == (36, 5)  # decomposed through its root: 5 eigenpairs
    for step, grad, fs in zip(steps, grads, factors):
        torch.testing.assert_close(step.flatten(), trace_norm_reference(fs, grad, LAMBDA))


def test_trace_norm_eigh_applies_a_new_damping_without_a_new_decomposition():
    """``inverse_interval=10``, ``λ_t = 0.05 (1 + t)``: step 1 uses step 0's decomposition
    (its factors) with ``λ_1``, where the Cholesky inverses keep ``λ_0`` until they are due."""
    schedule = ScheduledLambda()
    steps = {}
    for damping_kind in ("trace_norm_eigh", "trace_norm"):
        model = curvopt.extend(conv_net())
        lossfunc = curvopt.extend(nn.CrossEntropyLoss())
        opt = KFAC(
            model.parameters(),
            1.0,
            schedule,
            "kflr",
            kronecker_damping=damping_kind,
            inverse_interval=10,
            kl_clip=None,
        )
        optimizer_step(model, lossfunc, opt)
        first = [[f.clone() for f in opt.state[p]["curvature"]] for p in model.parameters()]
        x, y = batch(seed=2)
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        lossfunc(model(x), y).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        steps[damping_kind] = [b - p.detach() for b, p in zip(before, model.parameters())]
        if damping_kind == "trace_norm_eigh":
            for p, step, grad, fs in zip(model.parameters(), steps[damping_kind], grads, first):
                assert opt.state[p]["trace_norm_eigh"]["step"] == 0
                torch.testing.assert_close(
                    step.flatten(), trace_norm_reference(fs, grad, schedule(1))
                )
    assert not torch.allclose(steps["trace_norm_eigh"][0], steps["trace_norm"][0], rtol=1e-3)


class ScheduledLambda:
    """``λ_t = 0.05 (1 + t)`` (a picklable callable)."""

    def __call__(self, step: int) -> float:
        return 0.05 * (1 + step)


def _wide_linear(dtype, **options):
    """A seeded extended ``Linear(40, 30)`` in ``dtype``, its loss, and ``KFAC`` on KFLR with
    lr 1, damping ``LAMBDA``, no trust region and ``options``."""
    torch.manual_seed(0)
    model = curvopt.extend(nn.Linear(40, 30).to(dtype))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    opt = KFAC(model.parameters(), 1.0, LAMBDA, "kflr", kl_clip=None, **options)
    return model, lossfunc, opt


@pytest.mark.parametrize("damping_kind", ["trace_norm", "trace_norm_eigh"])
def test_max_rank_caps_dense_factors_in_the_inverse_and_the_factored_step(
    damping_kind, monkeypatch
):
    """``max_rank=4`` on a Linear 40 -> 30 whose averaged input factor has become dense
    (``curvature_ema`` over 8 batches of 6): ``A`` (40 > 8) is replaced by its top 4
    eigenpairs, ``B`` (30 > 8) too, the shifts from the full traces; the step is the factored
    one (from the batch's 6 rows), and visibly not the uncapped step."""
    factored = []
    original = curvopt.optim.kfac._factored

    def spy(*args):
        result = original(*args)
        factored.append(result is not None)
        return result

    monkeypatch.setattr(curvopt.optim.kfac, "_factored", spy)
    results = {}
    for max_rank in (4, None):
        model, lossfunc, opt = _wide_linear(
            DT, kronecker_damping=damping_kind, max_rank=max_rank, curvature_ema=0.5
        )
        gen = torch.Generator().manual_seed(5)
        for _ in range(9):
            x = 10 * torch.randn(6, 40, generator=gen, dtype=DT)
            y = torch.randint(0, 30, (6,), generator=gen)
            before = model.weight.detach().clone()
            factored.clear()
            opt.zero_grad()
            with opt.collect():  # KFAC captures the layers' rows from its first collect() on
                lossfunc(model(x), y).backward()
            opt.step()
        step = before - model.weight.detach()
        factors = opt.state[model.weight]["curvature"]
        results[max_rank] = (step, model.weight.grad.clone(), factors, factored[0])
    step, grad, factors, was_factored = results[4]
    assert was_factored  # the weight's step was the factored one
    torch.testing.assert_close(
        step.flatten(), capped_trace_norm_reference(factors, grad, LAMBDA, 4)
    )
    exact_step, exact_grad, exact_factors, _ = results[None]
    torch.testing.assert_close(
        exact_step.flatten(), trace_norm_reference(exact_factors, exact_grad, LAMBDA)
    )
    assert float((step - exact_step).norm() / exact_step.norm()) > 0.05


def test_max_rank_is_validated():
    params = list(conv_net().parameters())
    with pytest.raises(ValueError, match="max_rank caps the trace-norm inverses"):
        KFAC(params, 0.1, 0.1, kronecker_damping="exact", max_rank=8)
    with pytest.raises(ValueError, match="max_rank must be an int >= 1"):
        KFAC(params, 0.1, 0.1, max_rank=0)
    with pytest.raises(ValueError, match="kronecker_damping must be one of"):
        KFAC(params, 0.1, 0.1, kronecker_damping="eigh")


def test_trace_norm_eigh_with_rank_cap_resumes_from_a_weights_only_state_dict():
    """The decompositions and their rank-capped inverses are saved with ``state_dict`` and
    load with ``weights_only=True``; the resumed optimizer takes the same next step."""
    model = curvopt.extend(conv_net())
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())

    def make(m):
        return KFAC(
            m.parameters(),
            1.0,
            LAMBDA,
            "kflr",
            kronecker_damping="trace_norm_eigh",
            max_rank=2,
            inverse_interval=5,
            kl_clip=None,
        )

    opt = make(model)
    optimizer_step(model, lossfunc, opt)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    twin = curvopt.extend(copy.deepcopy(model))
    resumed = make(twin)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    state = resumed.state[twin[0].weight]
    assert state["trace_norm_eigh"]["value"][1][1].shape == (18, 2)  # A: 18 > 4, capped at 2
    for a, b in zip(optimizer_step(model, lossfunc, opt), optimizer_step(twin, lossfunc, resumed)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ----------------------------------------------------------------- one-sided EKFAC


def per_sample_grads(model, lossfunc, x, y, param_index):
    """``g_n`` of the loss as computed (``mean``: ``l_n / N``), by a loop over samples."""
    n = len(x)
    scale = 1 / n if lossfunc.reduction == "mean" else 1.0
    grads = []
    for i in range(n):
        loss = nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1], reduction="sum")
        param = list(model.parameters())[param_index]
        grads.append(scale * torch.autograd.grad(loss, param)[0])
    return torch.stack(grads)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_one_sided_ekfac_step_equals_dense_reference(reduction):
    """``max_basis_dim=10`` on Linear(30, 4): the input side (30) keeps the identity, the output
    side the eigenbasis of ``B`` from the previous step's factors; ``S`` the empirical Fisher's
    diagonal in that basis from per-sample gradients of a loop; the first step in the identity
    basis (``S`` = diag EF). The narrow layers keep their two-sided bases."""
    torch.manual_seed(0)
    model = curvopt.extend(nn.Sequential(nn.Linear(30, 4), nn.Tanh(), nn.Linear(4, 3)).to(DT))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss(reduction=reduction))
    opt = EKFAC(model.parameters(), 1.0, LAMBDA, "kflr", max_basis_dim=10, kl_clip=None)
    weight = model[0].weight
    gen = torch.Generator().manual_seed(3)
    c = 8 if reduction == "mean" else 1
    basis = torch.eye(4, dtype=DT)  # the first step: identity on both sides
    for _ in range(3):
        x, y = (
            5 * torch.randn(8, 30, generator=gen, dtype=DT),
            torch.randint(0, 3, (8,), generator=gen),
        )
        grads = per_sample_grads(model, lossfunc, x, y, 0)
        twin = curvopt.extend(copy.deepcopy(model))
        with curvopt.collect(ext.KFLR()):
            lossfunc(twin(x), y).backward()
        output_factor = twin[0].weight.kflr[0]
        before = weight.detach().clone()
        opt.zero_grad()
        lossfunc(model(x), y).backward()
        opt.step()
        rotation = torch.kron(basis.contiguous(), torch.eye(30, dtype=DT))
        moments = c * ((basis.T @ grads).reshape(8, -1) ** 2).sum(0)  # vec S, Q_Bᵀ G_n rows
        curvature = rotation @ torch.diag(moments) @ rotation.T
        expected = torch.linalg.solve(
            curvature + LAMBDA * torch.eye(120, dtype=DT), grads.sum(0).flatten()
        )
        torch.testing.assert_close((before - weight.detach()).flatten(), expected)
        # the next basis: the eigenvectors of this step's B (an input-side one is never formed)
        pending = opt.state[weight]["bases_next"]
        assert pending[1] is None
        basis = pending[0]
        rotated = basis.T @ output_factor @ basis
        torch.testing.assert_close(rotated, torch.diag(rotated.diagonal()))
    assert len(opt.state[weight]["curvature"]) == 2  # [S, Q_B]: the identity side dropped
    assert len(opt.state[model[2].weight]["curvature"]) == 3  # two-sided


def test_max_basis_dim_is_validated():
    with pytest.raises(ValueError, match="max_basis_dim must be an int >= 1"):
        EKFAC(conv_net().parameters(), 0.1, 0.1, max_basis_dim=0)


@pytest.mark.parametrize("max_rank", [None, 4])
def test_trace_norm_eigh_in_bfloat16_factorises_in_float32(max_rank):
    """A bfloat16 model: the decomposition runs in float32 (its eigenvectors are float32), the
    step is bfloat16 and within bfloat16's rounding of the float64 model's step."""
    steps = {}
    for dtype in (torch.float64, torch.bfloat16):
        model, lossfunc, opt = _wide_linear(
            dtype, kronecker_damping="trace_norm_eigh", max_rank=max_rank
        )
        gen = torch.Generator().manual_seed(5)
        x = (10 * torch.randn(60, 40, generator=gen, dtype=DT)).to(dtype)
        y = torch.randint(0, 30, (60,), generator=gen)
        before = model.weight.detach().clone()
        lossfunc(model(x), y).backward()
        opt.step()
        steps[dtype] = (before - model.weight.detach()).double()
        (_, vectors), _ = opt.state[model.weight]["trace_norm_eigh"]["value"]
        assert vectors.dtype == (torch.float32 if dtype == torch.bfloat16 else DT)
    error = (steps[torch.bfloat16] - steps[torch.float64]).norm() / steps[torch.float64].norm()
    assert float(error) < 0.05
