"""The optimizers of ``curvopt.optim`` on quantities computed by ``curvopt.collect``."""

import contextlib

import pytest
import torch
from torch import nn

import curvopt
from curvopt.optim import KFAC, DiagGGNNewton, LevenbergMarquardt, VarianceAdaptedSGD

DT = torch.float64
torch.set_num_threads(1)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def mlp(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DT)
    return curvopt.extend(model)


def data(N=6, seed=1, classes=3):
    X = torch.randn(N, 4, generator=gen(seed), dtype=DT)
    y = torch.randint(0, classes, (N,), generator=gen(seed + 1))
    return X, y


def train(model, opt, lossfunc, X, y, steps, use_closure, seed=0):
    """``steps`` steps on one batch, either with ``step(closure)`` or the ``collect()`` form."""
    torch.manual_seed(seed)  # Monte-Carlo curvature draws from the global generator
    losses = []
    for _ in range(steps):
        if use_closure:

            def closure():
                opt.zero_grad()
                loss = lossfunc(model(X), y)
                loss.backward()
                return loss

            losses.append(float(opt.step(closure).detach()))
        else:
            opt.zero_grad()
            loss = lossfunc(model(X), y)
            with opt.collect():
                loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    return losses


def least_squares(orthogonal):
    X = torch.randn(10, 3, generator=gen(3), dtype=DT)
    if orthogonal:  # X^T X diagonal: the diagonal GGN is the GGN
        X = torch.linalg.qr(X)[0] * torch.tensor([1.0, 2.0, 0.5], dtype=DT)
    Y = torch.randn(10, 2, generator=gen(4), dtype=DT)
    layer = curvopt.extend(nn.Linear(3, 2, bias=False).to(DT))
    return layer, X, Y, torch.linalg.lstsq(X, Y).solution.T


# ----------------------------------------------------------------------------- first order


def test_variance_adapted_sgd_equals_sgd_when_all_samples_agree():
    x, target = data(N=1)
    X, y = x.repeat(5, 1), target.repeat(5)  # five copies of one sample
    model, reference = mlp(), mlp()
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    opt = VarianceAdaptedSGD(model.parameters(), lr=0.5)
    train(model, opt, lossfunc, X, y, steps=3, use_closure=True)
    sgd = torch.optim.SGD(reference.parameters(), lr=0.5)
    for _ in range(3):
        sgd.zero_grad()
        nn.functional.cross_entropy(reference(X), y).backward()
        sgd.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q)


def test_variance_adapted_sgd_shrinks_noisy_steps():
    X, y = data()
    model, reference = mlp(), mlp()
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    opt = VarianceAdaptedSGD(model.parameters(), lr=0.5)
    train(model, opt, lossfunc, X, y, steps=1, use_closure=False)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert (p - q).abs().le(0.5 * p.grad.abs() + 1e-12).all()
        assert (p - q).abs().sum() < 0.5 * p.grad.abs().sum()


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_variance_adapted_sgd_closure_equals_collect_form(momentum):
    X, y = data()
    lossfunc = curvopt.extend(nn.CrossEntropyLoss(reduction="sum"))
    results = []
    for use_closure in (True, False):
        model = mlp()
        opt = VarianceAdaptedSGD(model.parameters(), lr=0.1, momentum=momentum)
        train(model, opt, lossfunc, X, y, steps=3, use_closure=use_closure)
        results.append(list(model.parameters()))
    for p, q in zip(*results):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------- second order


def test_diag_ggn_newton_step_solves_least_squares():
    layer, X, Y, solution = least_squares(orthogonal=True)
    opt = DiagGGNNewton(layer.parameters(), lr=1.0, damping=0.0, curvature="exact", kl_clip=None)
    train(layer, opt, curvopt.extend(nn.MSELoss()), X, Y, steps=1, use_closure=False)
    torch.testing.assert_close(layer.weight.detach(), solution)


@pytest.mark.parametrize("kronecker_damping", ["trace_norm", "exact"])
def test_kfac_kflr_step_solves_least_squares(kronecker_damping):
    layer, X, Y, solution = least_squares(orthogonal=False)
    opt = KFAC(
        layer.parameters(),
        lr=1.0,
        damping=0.0,
        curvature="kflr",
        kronecker_damping=kronecker_damping,
        kl_clip=None,
    )
    train(layer, opt, curvopt.extend(nn.MSELoss()), X, Y, steps=1, use_closure=True)
    torch.testing.assert_close(layer.weight.detach(), solution)


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: DiagGGNNewton(ps, lr=0.5, damping=1.0, curvature="mc"),
        lambda ps: DiagGGNNewton(ps, lr=0.5, damping=1.0, curvature="exact", momentum=0.5),
        lambda ps: KFAC(ps, lr=0.5, damping=1e-2, curvature="kfac", mc_samples=16),
        lambda ps: KFAC(ps, lr=0.5, damping=1e-2, curvature="kflr", curvature_interval=2),
        lambda ps: KFAC(ps, lr=0.5, damping=1e-2, curvature="kfra", kronecker_damping="exact"),
    ],
    ids=["diag-mc", "diag-exact-momentum", "kfac", "kflr-interval", "kfra-exact"],
)
def test_closure_equals_collect_form_and_decreases_the_loss(make):
    X, y = data()
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    results = []
    for use_closure in (True, False):
        model = mlp()
        losses = train(
            model, make(model.parameters()), lossfunc, X, y, steps=4, use_closure=use_closure
        )
        results.append((losses, list(model.parameters())))
    (losses, params), (_, params2) = results
    for p, q in zip(params, params2):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-10)
    assert losses[-1] < losses[0]


def test_curvature_is_collected_only_every_k_steps():
    X, y = data()
    model = mlp()
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    opt = KFAC(model.parameters(), lr=0.1, damping=1e-2, curvature="kflr", curvature_interval=3)
    kinds = []
    for _ in range(4):
        kinds.append(type(opt.collect()))
        train(model, opt, lossfunc, X, y, steps=1, use_closure=False)
    assert [k is contextlib.nullcontext for k in kinds] == [False, True, True, False]


def test_levenberg_marquardt_with_the_engine():
    X, y = data()
    model = mlp()
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    opt = KFAC(
        model.parameters(), lr=1.0, damping=LevenbergMarquardt(1.0, interval=1), curvature="kflr"
    )
    losses = train(model, opt, lossfunc, X, y, steps=5, use_closure=True)
    assert opt.damping() < 1.0  # good steps on a well-modelled problem lower the damping
    assert losses[-1] < losses[0]


def test_kfac_on_a_small_cnn():
    torch.manual_seed(0)
    model = curvopt.extend(
        nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 4 * 4, 3)).to(DT)
    )
    X = torch.randn(4, 1, 6, 6, generator=gen(5), dtype=DT)
    y = torch.randint(0, 3, (4,), generator=gen(6))
    opt = KFAC(model.parameters(), lr=0.5, damping=1e-2, curvature="kfac")
    losses = train(
        model, opt, curvopt.extend(nn.CrossEntropyLoss()), X, y, steps=5, use_closure=True
    )
    assert losses[-1] < losses[0]


def test_param_groups_share_one_collect():
    model = mlp()
    first, second = list(model.parameters())[:2], list(model.parameters())[2:]
    opt = KFAC([{"params": first}, {"params": second, "lr": 0.05}], lr=0.1, damping=1e-2)
    extensions = opt.collect().extensions
    assert len(extensions) == 1 and type(extensions[0]).__name__ == "KFAC"
    opt = KFAC([{"params": first}, {"params": second, "mc_samples": 2}], lr=0.1, damping=1e-2)
    with pytest.raises(ValueError, match="different options"):
        opt.collect()
