"""The optimizers' formulas checked numerically (issue 14 items 11 and 14).

Each test computes the expected value independently (torch.func / plain tensor algebra) and
compares it with what the optimizer did, so a swapped ``β``/``1−β``, a doubled quadratic term,
a dropped weight-decay term or the wrong curvature fails.
"""

import copy
import math

import pytest
import torch
from conftest import DT, assert_close
from torch import nn

import curvopt
from curvopt import extensions as ext


class _TwoHeads(nn.Module):
    """``a(x) + b(x)``, where ``b`` may be left out of a step."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 2)
        self.b = nn.Linear(3, 2)

    def forward(self, x, use_b=True):
        return self.a(x) + self.b(x) if use_b else self.a(x)


OPTIMIZERS = {
    "kfac": lambda p, **kw: curvopt.optim.KFAC(p, lr=0.1, damping=1.0, kl_clip=None, **kw),
    "kflr": lambda p, **kw: curvopt.optim.KFAC(
        p, lr=0.1, damping=1.0, curvature="kflr", kl_clip=None, **kw
    ),
    "diag": lambda p, **kw: curvopt.optim.DiagGGNNewton(p, lr=0.1, damping=1.0, kl_clip=None, **kw),
    "vsgd": lambda p, **kw: curvopt.optim.VarianceAdaptedSGD(p, lr=0.1, **kw),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_zero_grad_without_none_and_unused_parameter(name, seed):
    """Item 11: ``zero_grad(set_to_none=False)`` and a parameter unused in a step: as in
    ``torch.optim``, its zero gradient gives a zero step (no false 'already used' error); the
    used parameters still take their step."""
    model = curvopt.extend(_TwoHeads().to(DT))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    opt = OPTIMIZERS[name](model.parameters())
    x, y = torch.randn(4, 3, dtype=DT), torch.randint(0, 2, (4,))
    for use_b in (True, False, True):
        opt.zero_grad(set_to_none=False)
        with opt.collect():
            lossfunc(model(x, use_b), y).backward()
        before = {k: p.detach().clone() for k, p in model.named_parameters()}
        opt.step()
        for k, p in model.named_parameters():
            moved = not torch.equal(before[k], p)
            assert moved == (use_b or k.startswith("a.")), f"{k} moved={moved} (use_b={use_b})"


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_stale_quantities_with_nonzero_grad_still_raise(name, seed):
    """Explicit mode: a backward pass outside ``opt.collect()`` (non-zero gradient, old
    quantities) raises."""
    model = curvopt.extend(_TwoHeads().to(DT))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    opt = OPTIMIZERS[name](model.parameters(), collection="explicit")
    x, y = torch.randn(4, 3, dtype=DT), torch.randint(0, 2, (4,))
    with opt.collect():
        lossfunc(model(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    lossfunc(model(x), y).backward()
    with pytest.raises(RuntimeError, match="already used"):
        opt.step()


# ------------------------------------------------------------------------------ item 14
# A single Linear layer with cross-entropy: its exact curvature is known in closed form, so every
# expected value below is computed without curvopt.


def _linear_problem(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, generator=g, dtype=DT), torch.randint(0, 2, (n,), generator=g)


def _loss(weight, bias, x, y):
    return nn.functional.cross_entropy(x @ weight.T + bias, y)


def _exact_curvature(layer, x, y):
    """``(diag GGN of weight, of bias, B, A)``: ``B = Σ_n H_n`` (loss Hessians w.r.t. the
    logits, with the mean's ``1/N``), ``A = mean_n x_n x_nᵀ``, ``diag(B ⊗ x xᵀ)`` per sample."""
    out = layer(x).detach()
    hess = torch.func.hessian(lambda o: nn.functional.cross_entropy(o, y))(out)
    h = torch.stack([hess[i, :, i, :] for i in range(x.shape[0])])  # [N, C, C]
    diag_w = torch.einsum("ncc,ni->nci", h, x * x).sum(0)
    diag_b = torch.einsum("ncc->nc", h).sum(0)
    return diag_w, diag_b, h.sum(0), x.T @ x / x.shape[0]


def _step(opt, layer, lossfunc, x, y):
    opt.zero_grad()
    with opt.collect():
        lossfunc(layer(x), y).backward()
    before = [p.detach().clone() for p in layer.parameters()]
    opt.step()
    return [b - p.detach() for b, p in zip(before, layer.parameters())]


@pytest.mark.parametrize("beta", [0.8, 0.3])
def test_curvature_ema_diagonal(beta, seed):
    """``C_2 = β C_1 + (1 − β) C_new`` and the second step ``lr (C_2 + λ)⁻¹ g``."""
    layer = curvopt.extend(nn.Linear(3, 2).to(DT))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    lr, damping = 0.3, 0.05
    opt = curvopt.optim.DiagGGNNewton(
        layer.parameters(),
        lr=lr,
        damping=damping,
        curvature="exact",
        curvature_ema=beta,
        kl_clip=None,
    )
    (x1, y1), (x2, y2) = _linear_problem(4, 1), _linear_problem(4, 2)
    c1 = _exact_curvature(layer, x1, y1)
    _step(opt, layer, lossfunc, x1, y1)
    c2 = _exact_curvature(layer, x2, y2)
    grads = torch.autograd.grad(_loss(layer.weight, layer.bias, x2, y2), list(layer.parameters()))
    deltas = _step(opt, layer, lossfunc, x2, y2)
    for i, (g, delta) in enumerate(zip(grads, deltas)):
        curvature = beta * c1[i] + (1 - beta) * c2[i]
        assert_close(delta, lr * g / (curvature + damping), f"param {i}")


@pytest.mark.parametrize("beta", [0.8, 0.3])
def test_curvature_ema_kronecker(beta, seed):
    """Each Kronecker factor is averaged: ``B_2 = β B_1 + (1 − β) B_new`` (and ``A``), then the
    trace-norm damped step ``lr (B + √λ/π I)⁻¹ G (A + π√λ I)⁻¹``."""
    layer = curvopt.extend(nn.Linear(3, 2).to(DT))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    lr, damping = 0.3, 0.05
    opt = curvopt.optim.KFAC(
        layer.parameters(),
        lr=lr,
        damping=damping,
        curvature="kflr",
        curvature_ema=beta,
        kl_clip=None,
    )
    (x1, y1), (x2, y2) = _linear_problem(4, 1), _linear_problem(4, 2)
    _, _, b1, a1 = _exact_curvature(layer, x1, y1)
    _step(opt, layer, lossfunc, x1, y1)
    _, _, b2, a2 = _exact_curvature(layer, x2, y2)
    gw, gb = torch.autograd.grad(
        _loss(layer.weight, layer.bias, x2, y2), [layer.weight, layer.bias]
    )
    dw, db = _step(opt, layer, lossfunc, x2, y2)
    b, a = beta * b1 + (1 - beta) * b2, beta * a1 + (1 - beta) * a2
    assert_close(dw, lr * _trace_norm_step(b, a, gw, damping), "weight")
    assert_close(db, lr * torch.linalg.solve(b + damping * torch.eye(2, dtype=DT), gb), "bias")


def _trace_norm_step(b, a, g, damping):
    """``(B + √λ/π I)⁻¹ G (A + π√λ I)⁻¹`` with ``π = sqrt((tr A / dim A) / (tr B / dim B))``."""
    pi = ((a.trace() / a.shape[0]) / (b.trace() / b.shape[0])).sqrt()
    root = damping**0.5
    left = torch.linalg.solve(b + root / pi * torch.eye(b.shape[0], dtype=DT), g)
    return torch.linalg.solve(a + pi * root * torch.eye(a.shape[0], dtype=DT), left.T).T


def test_levenberg_marquardt_damping_update(monkeypatch, seed):
    """``ρ = actual / predicted`` with the objective ``L + δ/2 ‖θ‖²``:
    ``predicted = gᵀs + ½ sᵀ (C + δ I) s`` (``g = ∇L + δθ``), ``actual = L(θ+s) − L(θ) +
    δ/2 (‖θ+s‖² − ‖θ‖²)``; then ``λ ← ωλ`` if ``ρ < 1/4``, ``λ/ω`` if ``ρ > 3/4``. Checked as the
    exact ``(actual, predicted)`` the optimizer measures and as the resulting damping, over step
    sizes and weight decays that reach all three branches and an undefined ``ρ``."""
    seen = []
    original = curvopt.optim.newton.reduction_ratio

    def spy(actual, predicted):
        seen.append((actual, predicted))
        return original(actual, predicted)

    monkeypatch.setattr(curvopt.optim.newton, "reduction_ratio", spy)
    x, y = _linear_problem(6, 3)
    lam0, omega = 0.1, 2.0
    outcomes = set()
    cases = [(0.0, lr) for lr in (0.5, 3.0, 6.0)] + [(0.2, lr) for lr in (0.5, 1.0, 2.0)]
    for weight_decay, lr in cases:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            layer = curvopt.extend(nn.Linear(3, 2).to(DT))
        lossfunc = curvopt.extend(nn.CrossEntropyLoss())
        strategy = curvopt.optim.LevenbergMarquardt(lam0, omega=omega, interval=1)
        opt = curvopt.optim.DiagGGNNewton(
            layer.parameters(),
            lr=lr,
            damping=strategy,
            curvature="exact",
            weight_decay=weight_decay,
            kl_clip=None,
        )
        w, b = (p.detach().clone() for p in layer.parameters())
        loss0 = _loss(w, b, x, y)
        gw, gb = torch.autograd.grad(_loss(w.requires_grad_(), b.requires_grad_(), x, y), [w, b])
        w, b = w.detach(), b.detach()
        cw, cb, _, _ = _exact_curvature(layer, x, y)
        predicted, steps = 0.0, []
        for theta, g, c in ((w, gw, cw), (b, gb, cb)):
            g = g + weight_decay * theta
            s = -lr * g / (c + lam0 + weight_decay)
            predicted += float((g * s).sum() + 0.5 * ((c + weight_decay) * s * s).sum())
            steps.append(s)
        actual = float(_loss(w + steps[0], b + steps[1], x, y) - loss0)
        actual += sum(
            0.5 * weight_decay * float(((t + s) ** 2).sum() - (t**2).sum())
            for t, s in zip((w, b), steps)
        )

        def closure(opt=opt, layer=layer, lossfunc=lossfunc):
            opt.zero_grad()
            loss = lossfunc(layer(x), y)
            loss.backward()
            return loss

        seen.clear()
        opt.step(closure)
        assert len(seen) == 1
        torch.testing.assert_close(seen[0], (actual, predicted), rtol=1e-9, atol=1e-14)
        rho = actual / predicted if predicted < 0 else math.nan  # undefined: no change
        expected = lam0 * omega if rho < 0.25 else lam0 / omega if rho > 0.75 else lam0
        outcomes.add(expected)
        what = f"lr={lr}, weight_decay={weight_decay}, rho={rho:.4f}"
        assert opt.damping() == pytest.approx(expected, rel=1e-12), what
    assert len(outcomes) == 3, f"the step sizes reach only {outcomes}"


def test_kfac_kfra_uses_kfra_factors(seed):
    """``KFAC(curvature="kfra")`` steps with ``p.kfra`` (not ``p.kflr``, which differs here)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        plain = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(DT)
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(5, 3, generator=g, dtype=DT), torch.randint(0, 2, (5,), generator=g)
    probe = curvopt.extend(copy.deepcopy(plain))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    with curvopt.collect(ext.KFRA(), ext.KFLR()):
        lossfunc(probe(x), y).backward()
    first = probe[0].weight
    assert not torch.allclose(first.kfra[0], first.kflr[0]), "KFRA equals KFLR: no test"
    model = curvopt.extend(copy.deepcopy(plain))
    lr, damping = 0.5, 0.01
    opt = curvopt.optim.KFAC(
        model.parameters(), lr=lr, damping=damping, curvature="kfra", kl_clip=None
    )
    deltas = _step(opt, model, lossfunc, x, y)
    for (name, p), delta in zip(probe.named_parameters(), deltas):
        if p.dim() == 2:
            expected = _trace_norm_step(*p.kfra, p.grad, damping)
        else:
            eye = torch.eye(p.shape[0], dtype=DT)
            expected = torch.linalg.solve(p.kfra[0] + damping * eye, p.grad)
        assert_close(delta, lr * expected, name)
