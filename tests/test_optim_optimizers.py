"""Tests of the optimizers of ``curvopt.optim`` with curvature written by hand.

The quantities that ``curvopt.collect`` would compute are set as parameter attributes by the
closures below, and ``opt.collect`` is replaced by a null context, so these tests exercise the
optimizers alone. ``test_optim_end_to_end.py`` runs them on the real engine.
"""

import contextlib
import copy
import io
import math
import pickle

import pytest
import torch
from torch import nn

from curvopt.optim import KFAC, DiagGGNNewton, LevenbergMarquardt, VarianceAdaptedSGD
from curvopt.optim.base import _all_zero, check_finite
from curvopt.optim.plan import ParamUpdate

DT = torch.float64
torch.set_num_threads(1)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def manual(opt):
    """``opt`` with collect() replaced by a null context: the closure writes the quantities."""
    opt.collect = contextlib.nullcontext
    return opt


def fake_diag(p):
    """A positive, parameter-dependent stand-in for ``diag(G)``."""
    return 10 * p.grad**2 + 0.01


def fake_kron(p):
    """Parameter-dependent stand-ins for ``[B, A]`` (``[B]`` for a bias)."""
    G = p.grad.reshape(p.shape[0], -1)
    if p.dim() == 1:
        return [G @ G.T + 0.1 * torch.eye(p.shape[0], dtype=p.dtype)]
    return [
        G @ G.T + 0.1 * torch.eye(G.shape[0], dtype=p.dtype),
        G.T @ G + 0.2 * torch.eye(G.shape[1], dtype=p.dtype),
    ]


FAKES = {
    "diag_ggn_exact": fake_diag,
    "diag_ggn_mc": fake_diag,
    "kflr": fake_kron,
    "kfac": fake_kron,
    "variance": lambda p: 0.5 * p.grad**2,
    "batch_l2": lambda p: torch.zeros(4, dtype=p.dtype),
}


class Problem:
    """A small tanh network on a regression task, float64."""

    def __init__(self, seed=0):
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).to(DT)
        self.X = torch.randn(8, 4, generator=gen(seed + 1), dtype=DT)
        self.y = torch.randn(8, 2, generator=gen(seed + 2), dtype=DT)

    def params(self):
        return list(self.model.parameters())

    def loss(self):
        return ((self.model(self.X) - self.y) ** 2).mean()

    def closure(self, opt, *attrs):
        def closure():
            opt.zero_grad()
            loss = self.loss()
            loss.backward()
            for p in self.params():
                for attr in attrs:
                    setattr(p, attr, FAKES[attr](p))
            return loss

        return closure

    def state(self):
        return [p.detach().clone() for p in self.params()]


# ----------------------------------------------------------------------------- hyper-parameters


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: DiagGGNNewton(ps, lr=-0.1, damping=1e-3),
        lambda ps: DiagGGNNewton(ps, lr=0.1, damping=-1e-3),
        lambda ps: DiagGGNNewton(ps, lr=0.1, damping=1e-3, curvature="hessian"),
        lambda ps: DiagGGNNewton(ps, lr=0.1, damping=1e-3, weight_decay=-1.0),
        lambda ps: DiagGGNNewton(ps, lr=0.1, damping=1e-3, momentum=1.0),
        lambda ps: DiagGGNNewton(ps, lr=0.1, damping=1e-3, curvature_interval=0),
        lambda ps: DiagGGNNewton(ps, lr=0.1, damping=1e-3, fallback="adam"),
        lambda ps: DiagGGNNewton(ps, lr=math.nan, damping=1e-3),
        lambda ps: KFAC(ps, lr=-1.0, damping=1e-3),
        lambda ps: KFAC(ps, lr=0.1, damping=-1.0),
        lambda ps: KFAC(ps, lr=0.1, damping=1e-3, curvature="ggn"),
        lambda ps: KFAC(ps, lr=0.1, damping=1e-3, kronecker_damping="tikhonov"),
        lambda ps: KFAC(ps, lr=0.1, damping=1e-3, inverse_interval=0),
        lambda ps: KFAC(ps, lr=0.1, damping=1e-3, kl_clip=-1.0),
        lambda ps: KFAC(ps, lr=0.1, damping=1e-3, mc_samples=0),
        lambda ps: KFAC([{"params": ps, "damping": -1.0}], lr=0.1, damping=1e-3),
        lambda ps: VarianceAdaptedSGD(ps, lr=-0.1),
        lambda ps: VarianceAdaptedSGD(ps, lr=0.1, momentum=-0.5),
    ],
)
def test_constructors_reject_bad_hyper_parameters(make):
    with pytest.raises(ValueError):
        make(Problem().params())


def test_add_param_group_validates():
    problem = Problem()
    opt = KFAC(problem.params()[:2], lr=0.1, damping=1e-3)
    with pytest.raises(ValueError, match="lr"):
        opt.add_param_group({"params": problem.params()[2:], "lr": -1.0})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": problem.params()[2:], "lr": 0.5})
    assert len(opt.param_groups) == 2


# ----------------------------------------------------------------------------- exact Newton steps


def least_squares(N=8, D_in=3, D_out=2, orthogonal=False):
    X = torch.randn(N, D_in, generator=gen(3), dtype=DT)
    if orthogonal:  # orthogonal columns of different norms: X^T X is diagonal
        X = torch.linalg.qr(X)[0] * torch.tensor([1.0, 2.0, 0.5], dtype=DT)
    Y = torch.randn(N, D_out, generator=gen(4), dtype=DT)
    layer = nn.Linear(D_in, D_out, bias=False).to(DT)
    solution = torch.linalg.lstsq(X, Y).solution.T
    return layer, X, Y, solution


def test_diag_newton_step_solves_least_squares_with_orthogonal_features():
    layer, X, Y, solution = least_squares(orthogonal=True)
    opt = DiagGGNNewton(layer.parameters(), lr=1.0, damping=0.0, curvature="exact", kl_clip=None)
    nn.functional.mse_loss(layer(X), Y).backward()
    # GGN of the mean squared error: 2 / (N D_out) X^T X per output row
    layer.weight.diag_ggn_exact = (2 / (8 * 2) * (X**2).sum(0)).expand(2, 3).clone()
    opt.step()
    torch.testing.assert_close(layer.weight.detach(), solution)


@pytest.mark.parametrize("kronecker_damping", ["trace_norm", "exact"])
def test_kfac_newton_step_solves_least_squares(kronecker_damping):
    layer, X, Y, solution = least_squares()
    opt = KFAC(
        layer.parameters(),
        lr=1.0,
        damping=0.0,
        curvature="kflr",
        kronecker_damping=kronecker_damping,
        kl_clip=None,
    )
    nn.functional.mse_loss(layer(X), Y).backward()
    layer.weight.kflr = [2 / (8 * 2) * torch.eye(2, dtype=DT), X.T @ X]
    opt.step()
    torch.testing.assert_close(layer.weight.detach(), solution)


# ----------------------------------------------------------------------------- the update rule


def test_diag_update_rule_with_weight_decay_and_groups():
    problem = Problem()
    ps = problem.params()
    opt = DiagGGNNewton(
        [{"params": ps[:2]}, {"params": ps[2:], "lr": 0.5, "damping": 0.3, "weight_decay": 0.1}],
        lr=1.0,
        damping=1e-2,
        curvature="exact",
        kl_clip=None,
    )
    before = problem.state()
    problem.closure(opt, "diag_ggn_exact")()
    expected = []
    for p, old, (lr, lam, wd) in zip(ps, before, [(1.0, 1e-2, 0.0)] * 2 + [(0.5, 0.3, 0.1)] * 2):
        expected.append(old - lr * (p.grad + wd * old) / (p.diag_ggn_exact + lam + wd))
    opt.step()
    for p, e in zip(ps, expected):
        torch.testing.assert_close(p.detach(), e)


@pytest.mark.parametrize("kronecker_damping", ["trace_norm", "exact"])
def test_kfac_update_rule_matches_dense_solve(kronecker_damping):
    problem = Problem()
    ps = problem.params()
    lam, wd = 0.05, 0.01
    opt = manual(
        KFAC(
            ps,
            lr=0.7,
            damping=lam,
            curvature="kflr",
            weight_decay=wd,
            kronecker_damping=kronecker_damping,
            kl_clip=None,
        )
    )
    before = problem.state()
    problem.closure(opt, "kflr")()
    expected = []
    for p, old in zip(ps, before):
        factors, g = p.kflr, (p.grad + wd * old).flatten()
        eye = torch.eye(g.numel(), dtype=DT)
        if kronecker_damping == "exact" or len(factors) == 1:
            dense = torch.kron(*factors) if len(factors) == 2 else factors[0]
            dense = dense + (lam + wd) * eye
        else:
            B, A = factors
            pi = math.sqrt((A.trace() / A.shape[0]) / (B.trace() / B.shape[0]))
            r = math.sqrt(lam + wd)
            dense = torch.kron(
                B + r / pi * torch.eye(B.shape[0], dtype=DT),
                A + pi * r * torch.eye(A.shape[0], dtype=DT),
            )
        expected.append(old - 0.7 * torch.linalg.solve(dense, g).reshape(p.shape))
    opt.step()
    for p, e in zip(ps, expected):
        torch.testing.assert_close(p.detach(), e)


def test_momentum_and_kl_clip():
    problem = Problem()
    ps = problem.params()
    opt = manual(
        DiagGGNNewton(ps, lr=0.5, damping=0.1, curvature="exact", momentum=0.9, kl_clip=1e-4)
    )
    velocity = [torch.zeros_like(p) for p in ps]
    for _ in range(2):
        before = problem.state()
        opt.step(problem.closure(opt, "diag_ggn_exact"))
        grads = [p.grad for p in ps]
        dirs = [p.grad / (p.diag_ggn_exact + 0.1) for p in ps]
        total = sum(float((g * d).sum()) for g, d in zip(grads, dirs)) * 0.5**2
        nu = min(1.0, math.sqrt(1e-4 / total))
        assert nu < 1  # the clip is active
        velocity = [0.9 * v + nu * d for v, d in zip(velocity, dirs)]
        for p, old, v in zip(ps, before, velocity):
            torch.testing.assert_close(p.detach(), old - 0.5 * v)


def test_curvature_interval_and_ema():
    problem = Problem()
    ps = problem.params()
    opt = manual(
        DiagGGNNewton(
            ps,
            lr=0.1,
            damping=0.1,
            curvature="exact",
            curvature_interval=2,
            curvature_ema=0.5,
            kl_clip=None,
        )
    )
    opt.step(problem.closure(opt, "diag_ggn_exact"))
    first = [p.diag_ggn_exact for p in ps]
    before = problem.state()
    opt.step(problem.closure(opt, "diag_ggn_exact"))  # not a curvature step: reuses `first`
    for p, old, c in zip(ps, before, first):
        torch.testing.assert_close(p.detach(), old - 0.1 * p.grad / (c + 0.1))
    before = problem.state()
    opt.step(problem.closure(opt, "diag_ggn_exact"))  # curvature step: EMA with the new one
    for p, old, c in zip(ps, before, first):
        average = 0.5 * c + 0.5 * p.diag_ggn_exact
        torch.testing.assert_close(p.detach(), old - 0.1 * p.grad / (average + 0.1))


def test_inverse_interval_reuses_inverses():
    problem = Problem()
    ps = problem.params()
    opt = manual(KFAC(ps, lr=0.1, damping=0.1, curvature="kflr", inverse_interval=2, kl_clip=None))
    opt.step(problem.closure(opt, "kflr"))
    first = [[f.clone() for f in p.kflr] for p in ps]
    before = problem.state()
    opt.step(problem.closure(opt, "kflr"))  # new curvature, but the inverses are from step 0
    for p, old, factors in zip(ps, before, first):
        dense = torch.kron(*factors) if len(factors) == 2 else factors[0]
        B = factors[0]
        A = factors[1] if len(factors) == 2 else None
        if A is not None:
            pi = math.sqrt((A.trace() / A.shape[0]) / (B.trace() / B.shape[0]))
            r = math.sqrt(0.1)
            dense = torch.kron(
                B + r / pi * torch.eye(B.shape[0], dtype=DT),
                A + pi * r * torch.eye(A.shape[0], dtype=DT),
            )
        else:
            dense = dense + 0.1 * torch.eye(B.shape[0], dtype=DT)
        step = torch.linalg.solve(dense, p.grad.flatten()).reshape(p.shape)
        torch.testing.assert_close(p.detach(), old - 0.1 * step)


def test_lr_scheduler():
    problem = Problem()
    ps = problem.params()
    opt = manual(DiagGGNNewton(ps, lr=1.0, damping=0.1, curvature="exact", kl_clip=None))
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for lr in (1.0, 0.5, 0.25):
        assert opt.param_groups[0]["lr"] == lr
        before = problem.state()
        opt.step(problem.closure(opt, "diag_ggn_exact"))
        for p, old in zip(ps, before):
            torch.testing.assert_close(p.detach(), old - lr * p.grad / (p.diag_ggn_exact + 0.1))
        scheduler.step()


# ----------------------------------------------------------------------------- adaptive damping


def quadratic_closure(opt, w, h, factor):
    """Loss ½ Σ h w²; the curvature handed to the optimizer is ``factor · h``."""

    def closure():
        opt.zero_grad()
        loss = 0.5 * (h * w**2).sum()
        loss.backward()
        w.diag_ggn_exact = factor * h
        return loss

    return closure


def test_levenberg_marquardt_damping_rises_after_bad_step_and_falls_after_good_one():
    h = torch.tensor([1.0, 4.0, 0.5], dtype=DT)
    w = torch.tensor([1.0, -1.0, 2.0], dtype=DT, requires_grad=True)
    lm = LevenbergMarquardt(1e-3, omega=2.0, interval=1)
    opt = manual(DiagGGNNewton([w], lr=1.0, damping=lm, curvature="exact", kl_clip=None))
    assert opt.damping() == 1e-3
    opt.step(quadratic_closure(opt, w, h, factor=0.1))  # curvature too small: overshoot
    assert opt.damping() == 2e-3
    opt.step(quadratic_closure(opt, w, h, factor=1.0))  # exact curvature: rho ~ 1
    assert opt.damping() == 1e-3


def test_levenberg_marquardt_needs_a_closure():
    problem = Problem()
    opt = DiagGGNNewton(
        problem.params(), lr=0.1, damping=LevenbergMarquardt(1e-3), curvature="exact"
    )
    problem.closure(opt, "diag_ggn_exact")()
    before = problem.state()
    with pytest.raises(RuntimeError, match="closure"):
        opt.step()
    for p, old in zip(problem.params(), before):
        assert torch.equal(p.detach(), old)


# ----------------------------------------------------------------------------- state_dict


def make_kfac(params):
    return manual(
        KFAC(
            params,
            lr=0.3,
            damping=LevenbergMarquardt(1e-2, interval=1),
            curvature="kflr",
            weight_decay=1e-2,
            momentum=0.5,
            curvature_ema=0.5,
            curvature_interval=2,
            inverse_interval=3,
            kl_clip=1e-2,
        )
    )


def make_kfac_exact(params):
    return manual(
        KFAC(
            params,
            lr=0.3,
            damping=1e-2,
            curvature="kfac",
            kronecker_damping="exact",
            curvature_ema=0.9,
            inverse_interval=2,
        )
    )


def make_diag(params):
    return manual(
        DiagGGNNewton(
            params,
            lr=0.3,
            damping=LevenbergMarquardt(1e-2, interval=2),
            curvature="mc",
            momentum=0.9,
            curvature_interval=3,
        )
    )


def make_vasgd(params):
    return manual(VarianceAdaptedSGD(params, lr=0.3, momentum=0.9, weight_decay=1e-3))


@pytest.mark.parametrize(
    "make, attrs",
    [
        (make_kfac, ("kflr",)),
        (make_kfac_exact, ("kfac",)),
        (make_diag, ("diag_ggn_mc",)),
        (make_vasgd, ("variance", "batch_l2")),
    ],
)
def test_state_dict_round_trip_continues_the_same_trajectory(make, attrs):
    problem = Problem()
    opt = make(problem.params())
    for _ in range(4):
        opt.step(problem.closure(opt, *attrs))
    saved_params = problem.state()
    saved = opt.state_dict()  # not copied: later steps must not change it
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    for _ in range(5):
        opt.step(problem.closure(opt, *attrs))
    expected = problem.state()

    for state_dict in (saved, torch.load(io.BytesIO(buffer.getvalue()))):
        resumed = Problem()
        with torch.no_grad():
            for p, value in zip(resumed.params(), saved_params):
                p.copy_(value)
        opt2 = make(resumed.params())
        opt2.load_state_dict(state_dict)
        for _ in range(5):
            opt2.step(resumed.closure(opt2, *attrs))
        for p, e in zip(resumed.params(), expected):
            torch.testing.assert_close(p.detach(), e, rtol=0, atol=1e-6)


def test_state_dict_from_another_optimizer_is_rejected():
    problem = Problem()
    opt = KFAC(problem.params(), lr=0.1, damping=1e-3)
    with pytest.raises(ValueError, match="group_state"):
        opt.load_state_dict(torch.optim.SGD(problem.params(), lr=0.1).state_dict())


def test_optimizer_can_be_copied_and_pickled():
    problem = Problem()
    opt = manual(KFAC(problem.params(), lr=0.1, damping=1e-3, curvature="kflr"))
    opt.step(problem.closure(opt, "kflr"))
    assert copy.deepcopy(opt)._group_state == [{"step": 1, "damping": {}}]
    del opt.collect  # the instance attribute set by manual() holds a non-picklable class
    assert pickle.loads(pickle.dumps(opt))._group_state[0]["step"] == 1


# ----------------------------------------------------------------------------- robustness


def test_zero_curvature_parameters_stay_finite():
    problem = Problem()
    ps = problem.params()
    opt = DiagGGNNewton(ps, lr=0.1, damping=1e-2, curvature="exact")
    kfac = KFAC(ps, lr=0.1, damping=1e-2, curvature="kflr")
    problem.closure(opt)()
    for p in ps:
        p.diag_ggn_exact = torch.zeros_like(p)
        p.kflr = [
            torch.zeros(n, n, dtype=DT)
            for n in ([p.shape[0]] if p.dim() == 1 else [p.shape[0], p[0].numel()])
        ]
    opt.step()
    kfac.step()
    assert all(torch.isfinite(p).all() for p in ps)


@pytest.mark.parametrize("poison", ["grad", "curvature", "zero_damping"])
def test_non_finite_steps_raise_and_change_nothing(poison):
    problem = Problem()
    ps = problem.params()
    opt = DiagGGNNewton(
        ps,
        lr=0.1,
        damping=0.0 if poison == "zero_damping" else 1e-2,
        curvature="exact",
        momentum=0.9,
    )
    problem.closure(opt, "diag_ggn_exact")()
    opt.step()
    state = copy.deepcopy(opt.state_dict())
    problem.closure(opt, "diag_ggn_exact")()
    if poison == "grad":
        ps[-1].grad[0] = math.nan
    elif poison == "curvature":
        ps[-1].diag_ggn_exact[0] = math.inf
    else:
        ps[-1].diag_ggn_exact.zero_()
        ps[-1].grad.zero_()
    before = problem.state()
    with pytest.raises(FloatingPointError, match=r"parameter #3 \(shape \(2,\)\)"):
        opt.step()
    for p, old in zip(ps, before):
        assert torch.equal(p.detach(), old)
    assert opt.state_dict()["group_state"] == state["group_state"]
    assert all(
        torch.equal(opt.state[p]["momentum"], state["state"][i]["momentum"])
        for i, p in enumerate(ps)
    )


def test_missing_curvature_names_the_parameter_and_the_fallback():
    model = nn.Sequential(nn.Linear(3, 2), nn.LayerNorm(2)).to(DT)
    names = [n for n, _ in model.named_parameters()]
    opt = KFAC(model.named_parameters(), lr=0.1, damping=1e-2, curvature="kflr")
    model(torch.randn(4, 3, dtype=DT)).sum().backward()
    for name, p in model.named_parameters():
        if name.startswith("0."):
            p.kflr = fake_kron(p)
    message = r"'1.weight' \(shape \(2,\)\) has no `kflr`.*fallback='sgd'"
    with pytest.raises(RuntimeError, match=message):
        opt.step()
    assert names == ["0.weight", "0.bias", "1.weight", "1.bias"]


def test_fallback_sgd_updates_parameters_without_curvature():
    model = nn.Sequential(nn.Linear(3, 2), nn.LayerNorm(2)).to(DT)
    ps = list(model.parameters())
    opt = KFAC(
        [{"params": ps[:2]}, {"params": ps[2:], "fallback": "sgd"}],
        lr=0.1,
        damping=1e-2,
        curvature="kflr",
        weight_decay=0.1,
        kl_clip=None,
    )
    model(torch.randn(4, 3, dtype=DT)).sum().backward()
    with pytest.raises(RuntimeError, match=r"parameter #0 \(shape \(2, 3\)\) has no `kflr`"):
        opt.step()  # group 0 has no fallback
    for p in ps[:2]:
        p.kflr = fake_kron(p)
    before = [p.detach().clone() for p in ps]
    opt.step()
    for p, old in zip(ps[2:], before[2:]):
        torch.testing.assert_close(p.detach(), old - 0.1 * (p.grad + 0.1 * old))


def test_failed_inversion_names_the_parameter():
    problem = Problem()
    ps = problem.params()
    opt = KFAC(ps, lr=0.1, damping=0.0, curvature="kflr")
    problem.closure(opt, "kflr")()
    ps[1].kflr = [torch.zeros(3, 3, dtype=DT)]
    with pytest.raises(torch.linalg.LinAlgError, match=r"parameter #1 \(shape \(3,\)\).*damping"):
        opt.step()


def test_stale_curvature_is_detected():
    problem = Problem()
    opt = DiagGGNNewton(problem.params(), lr=0.1, damping=1e-2, curvature="exact")
    problem.closure(opt, "diag_ggn_exact")()
    opt.step()
    problem.closure(opt)()  # a new backward pass that did not write curvature
    with pytest.raises(RuntimeError, match="same object a previous step already used"):
        opt.step()


def test_kronecker_factors_of_the_wrong_shape_are_rejected():
    problem = Problem()
    ps = problem.params()
    opt = KFAC(ps, lr=0.1, damping=1e-2, curvature="kflr")
    problem.closure(opt, "kflr")()
    ps[0].kflr = [torch.eye(3, dtype=DT), torch.eye(5, dtype=DT)]
    with pytest.raises(ValueError, match=r"parameter #0 \(shape \(3, 4\)\).*do not match"):
        opt.step()


# ----------------------------------------------------------------------------- VarianceAdaptedSGD


def test_variance_adapted_sgd_equals_sgd_without_variance():
    problem, reference = Problem(), Problem()
    opt = manual(VarianceAdaptedSGD(problem.params(), lr=0.1, weight_decay=0.01))
    sgd = torch.optim.SGD(reference.params(), lr=0.1, weight_decay=0.01)
    closure = problem.closure(opt, "batch_l2")

    def with_zero_variance():
        loss = closure()
        for p in problem.params():
            p.variance = torch.zeros_like(p)
        return loss

    for _ in range(3):
        opt.step(with_zero_variance)
        sgd.zero_grad()
        reference.loss().backward()
        sgd.step()
    for p, q in zip(problem.params(), reference.params()):
        torch.testing.assert_close(p, q)


def test_variance_adapted_sgd_update_rule():
    problem = Problem()
    ps = problem.params()
    beta = 0.9
    opt = manual(VarianceAdaptedSGD(ps, lr=0.1, momentum=beta))
    averages = [torch.zeros_like(p) for p in ps]
    for t in (1, 2):
        before = problem.state()
        opt.step(problem.closure(opt, "variance", "batch_l2"))
        rho = (1 - beta) * (1 + beta**t) / ((1 + beta) * (1 - beta**t))
        for i, (p, old) in enumerate(zip(ps, before)):
            averages[i] = beta * averages[i] + (1 - beta) * p.grad
            m = averages[i] / (1 - beta**t)
            s = 4**2 / 3 * p.variance  # N = 4 samples
            torch.testing.assert_close(p.detach(), old - 0.1 * m**2 / (m**2 + rho * s) * m)


def test_finite_check_tolerates_overflowing_sums_and_names_the_bad_tensor():
    p = torch.zeros(2)
    big = torch.full((4,), 3e38)  # finite entries, float32 sum overflows to inf
    update = ParamUpdate(p, "parameter 'w' (shape (2,))", checks=[("gradient", big)])
    check_finite([update])
    bad = ParamUpdate(
        p, "parameter 'v' (shape (2,))", checks=[("update", torch.tensor([1, -math.inf]))]
    )
    with pytest.raises(FloatingPointError, match=r"update of parameter 'v'"):
        check_finite([update, bad])


def _moved(param, delta, description="parameter 'w'", checks=()):
    return ParamUpdate(param, description, delta=delta, checks=list(checks))


@pytest.mark.parametrize(
    "param, delta, bad",
    [
        (torch.ones(3), torch.ones(3), False),
        (torch.ones(3), torch.tensor([1.0, math.nan, 0.0]), True),
        (torch.tensor([3.0e38, 0.0]), torch.tensor([-3.0e38, 0.0]), True),  # |θ| + |Δ| > max
        (torch.tensor([3.0e38, 0.0]), torch.tensor([0.0, 3.0e38]), False),  # apart: in range
        (torch.full((2,), 3e38, dtype=torch.bfloat16), torch.full((2,), -3e38).bfloat16(), True),
        (torch.ones(2, dtype=torch.bfloat16), torch.full((2,), 3e38, dtype=torch.bfloat16), False),
        (torch.ones(2, dtype=DT), torch.full((2,), 1e300, dtype=DT), False),
        (torch.zeros(0, 3), torch.zeros(0, 3), False),  # no entries
    ],
)
def test_finite_check_of_a_step_reads_each_dtype_range(param, delta, bad):
    """``θ − Δ`` must stay finite in ``θ``'s dtype: ``‖θ‖∞ + ‖Δ‖∞ ≤ max`` passes without a
    look at the entries, a step beyond it is looked at and raises only if ``θ − Δ`` is not
    finite; beside other parameters of other dtypes and sizes (one foreach norm per list)."""
    others = [_moved(torch.ones(4, dtype=DT), torch.ones(4, dtype=DT), "parameter 'o'")]
    others.append(_moved(torch.zeros(0), torch.zeros(0), "parameter 'e'"))
    updates = [*others, _moved(param, delta)]
    if bad:
        with pytest.raises(FloatingPointError, match=r"parameter 'w'"):
            check_finite(updates)
    else:
        check_finite(updates)


def test_finite_check_reads_sparse_and_empty_checked_tensors():
    """A sparse gradient (``nn.Embedding(sparse=True)``) and one without entries are checked
    beside dense ones: a NaN among the sparse values raises, naming its tensor."""
    p = torch.zeros(3)
    sparse = torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (3,))
    fine = ParamUpdate(p, "parameter 'w'", checks=[("gradient", sparse), ("gradient", p[:0])])
    check_finite([fine])
    nan = torch.sparse_coo_tensor([[1]], [math.nan], (3,))
    bad = ParamUpdate(p, "parameter 's'", checks=[("gradient", nan)])
    with pytest.raises(FloatingPointError, match=r"gradient of parameter 's'"):
        check_finite([fine, bad])


def test_all_zero_tests_each_gradient_exactly():
    """The zero-gradient test of unused parameters (one foreach norm for all): entries of
    1e-30 in float32 (whose squares underflow to 0) are not zero, nor is a NaN or an inf; a
    tensor without entries and a sparse one without nonzero values are."""
    tensors = [
        torch.zeros(3),
        torch.full((4,), 1e-30),
        torch.tensor([0.0, math.nan]),
        torch.tensor([-math.inf, 0.0], dtype=DT),
        torch.zeros(0, 2),
        torch.sparse_coo_tensor([[1]], [0.0], (3,)),
        torch.zeros(2, 2, dtype=torch.bfloat16),
    ]
    assert _all_zero(tensors) == [True, False, False, False, True, True, True]
    assert _all_zero([]) == []


def test_momentum_of_a_fallback_parameter_does_not_alias_its_gradient():
    p = nn.Parameter(torch.ones(3, dtype=DT))
    opt = manual(
        DiagGGNNewton([p], lr=0.1, damping=1e-2, momentum=0.9, fallback="sgd", kl_clip=None)
    )
    p.grad = torch.full_like(p, 2.0)
    opt.step()
    p.grad.zero_()  # zero_grad(set_to_none=False) must not reset the velocity
    torch.testing.assert_close(opt.state[p]["momentum"], torch.full_like(p, 2.0))
