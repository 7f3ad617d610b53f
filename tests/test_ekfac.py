"""EKFAC (George et al. 2018): corrected eigenvalues, the optimizer's step and its basis refresh,
and ``linalg.EKFAC``, against dense float64 references built from per-sample gradients by
``torch.func`` (never from ``grad_batch``)."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import curvopt
from curvopt import extensions as ext
from curvopt import linalg
from curvopt.errors import MissingLossError, UnsupportedLossError
from curvopt.optim import EKFAC
from curvopt.inversion.eigen_corrected import kron_basis
from experiments.config import RunConfig
from experiments.optimizers import PRESETS, allowed_options, make_optimizer
from experiments.problems import get_problem

DT = torch.float64


def _mlp():
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4))


def _cnn():
    return nn.Sequential(nn.Conv2d(2, 3, 2), nn.Sigmoid(), nn.Flatten(), nn.Linear(12, 4))


MODELS = {
    "mlp": (_mlp, lambda g, n: torch.randn(n, 3, generator=g, dtype=DT)),
    "cnn": (_cnn, lambda g, n: torch.randn(n, 2, 3, 3, generator=g, dtype=DT)),
}


def _problem(name, n=6, reduction="mean", seed=0, scale=1.0):
    build, inputs = MODELS[name]
    torch.manual_seed(seed)
    model = build().to(DT)
    g = torch.Generator().manual_seed(seed + 1)
    x = inputs(g, n) * scale
    y = torch.randint(0, 4, (n,), generator=g)
    return model, nn.CrossEntropyLoss(reduction=reduction), x, y


def _dense_empirical_fisher(model, lossfunc, x, y):
    """``[per parameter: EF block [numel, numel]]``, ``(1/N) Σ ∇ℓ_n ∇ℓ_nᵀ`` ("mean") or the
    sum, from per-sample losses ``ℓ_n`` by ``vmap(grad)``."""
    params = {k: p.detach() for k, p in model.named_parameters()}
    single = nn.CrossEntropyLoss(reduction="sum")

    def loss(p, xi, yi):
        return single(functional_call(model, p, (xi[None],)), yi[None])

    grads = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    scale = 1 / len(x) if lossfunc.reduction == "mean" else 1.0
    return [scale * grads[k].flatten(1).T @ grads[k].flatten(1) for k in params]


def _kron(bases):
    q = bases[0]
    return torch.kron(q, bases[1]) if len(bases) == 2 else q


def _moment(grad_batch, bases, scale):
    """``scale · Σ_n (Q_Bᵀ G_n Q_A)²`` by explicit products over samples."""
    rows = bases[0].shape[0] if bases else 1
    total = 0
    for g in grad_batch:
        m = g.reshape(rows, -1)
        m = bases[0].T @ m if bases else m
        m = m @ bases[1] if len(bases) == 2 else m
        total = total + m**2
    return scale * total


def _collect(model, lossfunc, x, y, *extensions):
    model.zero_grad()
    with curvopt.collect(*extensions):
        lossfunc(model(x), y).backward()


# ----------------------------------------------------------------------------- the correction


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("n", [1, 7])
def test_corrected_eigenvalues_are_the_diagonal_of_the_rotated_empirical_fisher(name, reduction, n):
    model, lossfunc, x, y = _problem(name, n, reduction)
    dense = _dense_empirical_fisher(model, lossfunc, x, y)
    model, lossfunc = curvopt.extend(model), curvopt.extend(lossfunc)
    _collect(model, lossfunc, x, y, ext.EKFAC(factors="kflr"))
    written = [p.ekfac for p in model.parameters()]
    _collect(model, lossfunc, x, y, ext.KFLR())
    for p, ef, (corrected, *bases) in zip(model.parameters(), dense, written):
        assert all(torch.equal(q, k) for q, k in zip(bases, kron_basis(p.kflr)))
        q = _kron(bases)
        expected = torch.diagonal(q.T @ ef @ q)
        assert corrected.shape == (p.kflr[0].shape[0], p.numel() // p.kflr[0].shape[0])
        torch.testing.assert_close(corrected.flatten(), expected, rtol=1e-10, atol=1e-13)
    # no basis: the diagonal of the empirical Fisher itself
    _collect(model, lossfunc, x, y, ext.EKFAC(bases=lambda p: []))
    for p, ef in zip(model.parameters(), dense):
        torch.testing.assert_close(p.ekfac[0].flatten(), torch.diagonal(ef), rtol=1e-10, atol=1e-13)


# ----------------------------------------------------------------------------- the optimizer


def _ekfac_step_dense(p, bases, ef, damping, weight_decay, lr, grad_):
    """``θ − lr (Q diag(diag(Qᵀ EF Q)) Qᵀ + (λ+δ) I)⁻¹ (g + δθ)``, dense."""
    q = _kron(bases)
    curvature = q @ torch.diag(torch.diagonal(q.T @ ef @ q)) @ q.T
    system = curvature + (damping + weight_decay) * torch.eye(p.numel(), dtype=DT)
    g = grad_.flatten() + weight_decay * p.detach().flatten()
    return p.detach() - lr * torch.linalg.solve(system, g).reshape(p.shape)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", list(MODELS))
def test_step_is_the_dense_damped_newton_step_in_the_corrected_eigenbasis(name, reduction):
    """Inputs of scale 30: the factors' scales differ by orders of magnitude, so a wrong
    scaling of ``S`` (``N`` vs 1) or a damping applied to one side only shows."""
    model, lossfunc, x, y = _problem(name, 8, reduction, scale=30.0)
    dense = _dense_empirical_fisher(model, lossfunc, x, y)
    model, lossfunc = curvopt.extend(model), curvopt.extend(lossfunc)
    lr, damping, weight_decay = 0.7, 0.3, 0.05
    opt = EKFAC(  # the paper's update: the basis of this step's own factors
        model.parameters(),
        lr,
        damping,
        "kflr",
        weight_decay,
        reduction=reduction,
        kl_clip=None,
        basis_source="current",
    )
    _collect(model, lossfunc, x, y, ext.KFLR())
    factors = [[f.clone() for f in p.kflr] for p in model.parameters()]
    model.zero_grad()
    with opt.collect():
        lossfunc(model(x), y).backward()
    before = [(p.detach().clone(), p.grad.clone()) for p in model.parameters()]
    opt.step()
    for p, (theta, g), ef, fs in zip(model.parameters(), before, dense, factors):
        bases = opt.state[p]["curvature"][1:]
        for q, f in zip(bases, fs):  # the stored basis diagonalises the factor
            rotated = q.T @ f @ q
            off = rotated - torch.diag(torch.diagonal(rotated))
            assert off.abs().max() <= 1e-10 * f.abs().max()
        param = theta.requires_grad_(False)
        expected = _ekfac_step_dense(param, bases, ef, damping, weight_decay, lr, g)
        torch.testing.assert_close(p.detach(), expected, rtol=1e-9, atol=1e-12)


def test_basis_is_refreshed_every_k_steps_and_the_eigenvalues_every_step():
    model, lossfunc, x, y = _problem("mlp", 30, "mean")
    model, lossfunc = curvopt.extend(model), curvopt.extend(lossfunc)
    # the paper's schedule: a basis step's pass computes fresh bases from its own factors
    opt = EKFAC(model.parameters(), 0.1, 0.1, "kflr", basis_interval=3, basis_source="current")
    history, fresh = [], []
    for step in range(7):
        batch = slice(4 * step, 4 * step + 8)
        (wanted,) = opt._requests()[0]
        assert isinstance(wanted, ext.EKFAC) and wanted.options["factors"] == "kflr"
        fresh.append([wanted.supplied(p) is None for p in model.parameters()])
        opt.zero_grad()
        with curvopt.collect(wanted, ext.BatchGrad()):  # grad_batch for the reference only
            lossfunc(model(x[batch]), y[batch]).backward()
        grad_batches = [p.grad_batch.clone() for p in model.parameters()]
        opt.step()
        curvature = [opt.state[p]["curvature"] for p in model.parameters()]
        history.append((grad_batches, curvature))
    assert [all(f) or any(f) for f in fresh] == [s % 3 == 0 for s in range(7)]
    assert all(all(f) == any(f) for f in fresh)
    for step, (grad_batches, curvature) in enumerate(history):
        basis_step = step - step % 3
        for index, (gb, c) in enumerate(zip(grad_batches, curvature)):
            kept = history[basis_step][1][index][1:]
            assert all(torch.equal(q, k) for q, k in zip(c[1:], kept))
            # S of this step's per-sample gradients in the kept basis
            torch.testing.assert_close(c[0], _moment(gb, kept, gb.shape[0]))
            if step % 3:
                assert not torch.allclose(c[0], history[step - 1][1][index][0])
    for index in range(len(curvature)):  # refreshed at step 3 and 6
        for step in (3, 6):
            old, new = history[step - 1][1][index][1:], history[step][1][index][1:]
            assert not all(torch.allclose(a.abs(), b.abs()) for a, b in zip(old, new))


def _train(opt, model, lossfunc, x, y, steps):
    for step in range(steps):
        batch = slice((8 * step) % 24, (8 * step) % 24 + 8)
        opt.zero_grad()
        with opt.collect():
            lossfunc(model(x[batch]), y[batch]).backward()
        opt.step()


def test_state_dict_round_trip_continues_the_same_trajectory():
    """The resumed optimizer takes the saved one's steps. Both collect only inside
    ``opt.collect()``: an armed first optimizer would keep collecting its own next step's
    factors on the shared model (drawing Monte-Carlo samples the saved run did not draw). The
    factors the first one's later basis step left on the model are not read as the resumed
    one's: its next bases come only from the factors its own basis steps collect."""
    model, lossfunc, x, y = _problem("cnn", 32, "mean")
    model, lossfunc = curvopt.extend(model), curvopt.extend(lossfunc)
    options = {"basis_interval": 2, "momentum": 0.9, "kl_clip": 1e-2, "collection": "explicit"}
    opt = EKFAC(model.parameters(), 0.1, 0.1, "kfac", **options)
    torch.manual_seed(0)
    _train(opt, model, lossfunc, x, y, 3)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    torch.manual_seed(1)
    _train(opt, model, lossfunc, x, y, 3)
    expected = [p.detach().clone() for p in model.parameters()]

    model.load_state_dict(saved["model"])
    resumed = EKFAC(model.parameters(), 0.1, 0.1, "kfac", **options)
    resumed.load_state_dict(saved["opt"])
    torch.manual_seed(1)
    _train(resumed, model, lossfunc, x, y, 3)
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.detach(), e, rtol=0, atol=0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"lr": -1.0},
        {"damping": -1e-3},
        {"curvature": "kfra"},
        {"curvature": "mc"},
        {"reduction": "none"},
        {"basis_interval": 0},
        {"basis_interval": 3, "curvature_interval": 2},
        {"mc_samples": 0},
        {"momentum": 1.0},
        {"kl_clip": -1.0},
    ],
)
def test_invalid_arguments_raise_value_error(kwargs):
    params = [nn.Parameter(torch.zeros(2, 2))]
    arguments = {"lr": 0.1, "damping": 1e-3, **kwargs}
    with pytest.raises(ValueError):
        EKFAC(params, **arguments)


def test_curvature_ema_in_a_param_group_raises():
    opt = EKFAC([nn.Parameter(torch.zeros(2, 2))], 0.1, 1e-3)
    with pytest.raises(ValueError, match="curvature_ema"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))], "curvature_ema": 0.9})


def test_backward_outside_collect_raises_instead_of_reusing_stale_per_sample_gradients():
    """Explicit mode: only ``opt.collect()`` collects."""
    model, lossfunc, x, y = _problem("mlp", 8, "mean")
    model, lossfunc = curvopt.extend(model), curvopt.extend(lossfunc)
    opt = EKFAC(model.named_parameters(), 0.1, 0.1, "kflr", collection="explicit")
    with opt.collect():
        lossfunc(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    lossfunc(model(x), y).backward()
    with pytest.raises(RuntimeError, match="same object"):
        opt.step()


def test_a_pass_without_the_ekfac_quantity_raises_naming_it():
    """``grad_batch`` alone (the quantity the optimizer read before it had its own) is not
    enough: the step names the missing ``ekfac`` and changes nothing (explicit mode)."""
    model, lossfunc, x, y = _problem("mlp", 8, "sum")
    model, lossfunc = curvopt.extend(model), curvopt.extend(lossfunc)
    opt = EKFAC(model.parameters(), 1.0, 0.2, "kflr", collection="explicit")
    _collect(model, lossfunc, x, y, ext.BatchGrad())
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="has no `ekfac`"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_a_reduction_that_differs_from_the_loss_raises_in_the_backward_pass():
    model, lossfunc, x, y = _problem("mlp", 8, "sum")
    model, lossfunc = curvopt.extend(model), curvopt.extend(lossfunc)
    opt = EKFAC(model.parameters(), 1.0, 0.2, "kflr", reduction="mean")
    with pytest.raises(UnsupportedLossError, match="reduction='mean'.*reduction='sum'"):
        with opt.collect():
            lossfunc(model(x), y).backward()


# ----------------------------------------------------------------------------- linalg.EKFAC


def _block_diagonal(blocks):
    return torch.block_diag(*blocks)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", list(MODELS))
def test_linalg_ekfac_is_the_empirical_fisher_projected_onto_the_kronecker_eigenbasis(
    name, reduction
):
    """Two batches of different sizes: the corrections are weighted like one batch of all."""
    model, lossfunc, x, y = _problem(name, 9, reduction)
    dense = _dense_empirical_fisher(model, lossfunc, x, y)
    model, lossfunc = curvopt.extend(model), curvopt.extend(lossfunc)
    data = [(x[:4], y[:4]), (x[4:], y[4:])]
    op = linalg.EKFAC(model, lossfunc, data, curvature="kflr")
    kfac = linalg.KFAC(model, lossfunc, data, curvature="kflr")
    blocks = []
    for bases, factors, ef in zip(op.bases, kfac.factors, dense):
        for q, f in zip(bases, factors):
            rotated = q.T @ f @ q
            assert (
                rotated - torch.diag(torch.diagonal(rotated))
            ).abs().max() <= 1e-10 * f.abs().max()
        q = _kron(bases)
        blocks.append(q @ torch.diag(torch.diagonal(q.T @ ef @ q)) @ q.T)
    expected = _block_diagonal(blocks).numpy()
    assert op.shape == expected.shape
    np.testing.assert_allclose(op.to_dense(), expected, rtol=1e-9, atol=1e-12)
    # the same projection of linalg.EmpiricalFisher (per-sample rows)
    ef = linalg.EmpiricalFisher(model, lossfunc, data).to_dense()
    offsets = np.cumsum([0] + [p.numel() for p in model.parameters()])
    for i, bases in enumerate(op.bases):
        q = _kron(bases).numpy()
        block = ef[offsets[i] : offsets[i + 1], offsets[i] : offsets[i + 1]]
        np.testing.assert_allclose(
            op.corrections[i].flatten().numpy(), np.diagonal(q.T @ block @ q), rtol=1e-9, atol=1e-12
        )
    damping = 0.3
    inverse = np.linalg.inv(expected + damping * np.eye(len(expected)))
    np.testing.assert_allclose(op.inverse(damping).to_dense(), inverse, rtol=1e-8, atol=1e-10)


def test_linalg_ekfac_inverse_is_the_optimizer_step():
    model, lossfunc, x, y = _problem("cnn", 8, "mean", scale=30.0)
    model, lossfunc = curvopt.extend(model), curvopt.extend(lossfunc)
    op = linalg.EKFAC(model, lossfunc, [(x, y)], curvature="kflr")
    # linalg.EKFAC's basis is that of its data's factors: the paper's, this step's own
    opt = EKFAC(model.parameters(), 1.0, 0.2, "kflr", kl_clip=None, basis_source="current")
    with opt.collect():
        lossfunc(model(x), y).backward()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gradient = torch.cat([p.grad.flatten() for p in model.parameters()]).numpy()
    opt.step()
    step = flat - torch.cat([p.detach().flatten() for p in model.parameters()])
    np.testing.assert_allclose(step.numpy(), op.inverse(0.2) @ gradient, rtol=1e-8, atol=1e-12)


def test_linalg_ekfac_rejects_bad_input():
    model, lossfunc, x, y = _problem("mlp", 4, "mean")
    with pytest.raises(MissingLossError, match="extend"):
        linalg.EKFAC(curvopt.extend(model), lossfunc, [(x, y)])
    model, lossfunc = curvopt.extend(model), curvopt.extend(lossfunc)
    with pytest.raises(ValueError, match="curvature"):
        linalg.EKFAC(model, lossfunc, [(x, y)], curvature="kfra")
    with pytest.raises(ValueError, match="empty"):
        linalg.EKFAC(model, lossfunc, [])


def test_experiments_build_ekfac_with_its_presets_and_options():
    assert {"basis_interval", "reduction", "kl_clip", "momentum"} <= set(allowed_options("ekfac"))
    problem = get_problem("mnist_logreg")
    model, lossfunc = problem.model(0), problem.loss()
    cfg = RunConfig("mnist_logreg", "ekfac", 0.01, damping=0.1, preset="practical")
    opt, collects = make_optimizer(cfg, problem, model, lossfunc)
    group = opt.param_groups[0]
    assert collects and isinstance(opt, EKFAC)
    assert {k: group[k] for k in PRESETS["practical"]["EKFAC"]} == PRESETS["practical"]["EKFAC"]
    x, y = torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,))
    with torch.no_grad():
        first = lossfunc(model(x), y).item()
    for _ in range(3):
        opt.zero_grad()
        with opt.collect():
            lossfunc(model(x), y).backward()
        opt.step()
    with torch.no_grad():
        assert lossfunc(model(x), y).item() < first


def test_a_non_finite_correction_raises_naming_it_and_changes_nothing():
    model, lossfunc, x, y = _problem("mlp", 8, "mean")
    model, lossfunc = curvopt.extend(model), curvopt.extend(lossfunc)
    opt = EKFAC(model.named_parameters(), 0.1, 0.1, "kflr")
    with opt.collect():
        lossfunc(model(x), y).backward()
    model[2].weight.ekfac[0][0, 0] = math.inf
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(FloatingPointError, match=r"`ekfac`.*'2.weight'|'2.weight'.*`ekfac`"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert not opt.state
