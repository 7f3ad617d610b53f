"""Relative damping (``relative_damping=α``, the former default): ``λ = α m``, ``m`` the mean
over a param group of its curvatures' mean eigenvalues ``tr(C)/dim(C)``.

In float64 against hand-formed damped inverses: the Kronecker step with the trace-norm split
(``m`` from ``(tr B/dim B)(tr A/dim A)``), the diagonal step (``m`` from the diagonals' means),
EKFAC's (``m`` from the means of ``S``; a twin with that absolute damping). Scale invariance:
the loss multiplied by ``c`` gives the same steps (``kl_clip=None``), which an absolute damping
does not.
"""

import math

import pytest
import torch
from torch import nn

import curvopt
from curvopt.optim import EKFAC, KFAC, DiagGGNNewton, RelativeDamping

EXACT = {
    "KFAC": (KFAC, "kflr"),
    "EKFAC": (EKFAC, "kflr"),
    "DiagGGNNewton": (DiagGGNNewton, "exact"),
}


def _problem(seed=0, bias=True):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 6, bias=bias), nn.Tanh(), nn.Linear(6, 3, bias=bias))
    return curvopt.extend(model.double()), curvopt.extend(nn.CrossEntropyLoss())


def _batch(step, n=12):
    generator = torch.Generator().manual_seed(100 + step)
    X = torch.randn(n, 5, dtype=torch.float64, generator=generator)
    return X, torch.randint(0, 3, (n,), generator=generator)


def _steps(opt, model, lossfunc, count, scale=1.0):
    """The parameter changes of ``count`` steps on changing batches, the loss times ``scale``."""
    steps = []
    for step in range(count):
        opt.zero_grad()
        X, y = _batch(step)
        (scale * lossfunc(model(X), y)).backward()
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        steps.append([b - p.detach() for b, p in zip(before, model.parameters())])
    return steps


def _trace_norm_step(grad, factors, damping):
    """``(B + √λ/π I)⁻¹ G (A + π√λ I)⁻¹``, ``π = sqrt((tr A/dim A)/(tr B/dim B))``; a bias
    ``(B + λ I)⁻¹ g``."""
    eye = [torch.eye(len(f), dtype=f.dtype) for f in factors]
    if len(factors) == 1:
        return torch.linalg.solve(factors[0] + damping * eye[0], grad)
    (B, A), root = factors, math.sqrt(damping)
    pi = math.sqrt((A.trace() / len(A)) / (B.trace() / len(B)))
    return torch.linalg.solve(B + root / pi * eye[0], grad) @ torch.linalg.inv(
        A + pi * root * eye[1]
    )


def test_the_kronecker_damping_is_the_fraction_of_the_mean_eigenvalue():
    """``λ = α m``, ``m`` the mean over the parameters of ``(tr B/dim B)(tr A/dim A)`` (a
    bias: ``tr B/dim B``), in the trace-norm split."""
    model, lossfunc = _problem()
    alpha, lr = 0.3, 0.2
    opt = KFAC(model.parameters(), lr, curvature="kflr", relative_damping=alpha, kl_clip=None)
    X, y = _batch(0)
    lossfunc(model(X), y).backward()
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    params = list(model.parameters())
    scale = sum(math.prod(float(f.trace()) / len(f) for f in p.kflr) for p in params) / len(params)
    assert opt._group_state[0]["curvature_scale"] == pytest.approx(scale, rel=1e-12)
    for p, old in zip(params, before):
        expected = _trace_norm_step(p.grad, [f.detach() for f in p.kflr], alpha * scale)
        torch.testing.assert_close(old - p.detach(), lr * expected, rtol=1e-10, atol=1e-14)


def test_the_diagonal_damping_is_the_fraction_of_the_diagonals_mean():
    model, lossfunc = _problem()
    alpha, lr = 0.05, 0.2
    opt = DiagGGNNewton(
        model.parameters(), lr, curvature="exact", relative_damping=alpha, kl_clip=None
    )
    X, y = _batch(0)
    lossfunc(model(X), y).backward()
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    params = list(model.parameters())
    scale = sum(float(p.diag_ggn_exact.mean()) for p in params) / len(params)
    for p, old in zip(params, before):
        expected = p.grad / (p.diag_ggn_exact + alpha * scale)
        torch.testing.assert_close(old - p.detach(), lr * expected, rtol=1e-10, atol=1e-14)


def test_ekfac_damps_by_the_fraction_of_the_mean_corrected_eigenvalue():
    """EKFAC relative equals a twin with the absolute ``damping = α m``, ``m`` the mean over the
    parameters of ``mean(S)``."""
    alpha, lr = 0.2, 0.1
    model, lossfunc = _problem()
    opt = EKFAC(model.parameters(), lr, curvature="kflr", relative_damping=alpha, kl_clip=None)
    relative = _steps(opt, model, lossfunc, 1)[0]
    params = list(model.parameters())
    scale = sum(float(p.ekfac[0].mean()) for p in params) / len(params)
    model, lossfunc = _problem()
    twin = EKFAC(model.parameters(), lr, alpha * scale, "kflr", kl_clip=None)
    for a, b in zip(relative, _steps(twin, model, lossfunc, 1)[0]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("name", list(EXACT))
def test_relative_damping_makes_the_steps_independent_of_the_losss_scale(name):
    """The loss times 1000 (a per-pixel mean against a sum, say): the same four steps (one
    refresh, three plain ones: the kept scale) under relative damping, not under an absolute
    one."""
    cls, curvature = EXACT[name]
    runs = {}
    for damping in (None, 1e-3):
        for scale in (1.0, 1000.0):
            model, lossfunc = _problem()
            relative = {"relative_damping": 1.0 if name == "DiagGGNNewton" else 0.03}
            opt = cls(
                model.parameters(),
                0.1,
                damping,
                curvature,
                curvature_interval=2,
                kl_clip=None,
                **relative,
            )
            runs[damping, scale] = _steps(opt, model, lossfunc, 4, scale)
    for unscaled, scaled in zip(runs[None, 1.0], runs[None, 1000.0]):
        for a, b in zip(unscaled, scaled):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-13)
    first = runs[1e-3, 1.0][0][0], runs[1e-3, 1000.0][0][0]
    assert not torch.allclose(*first, rtol=1e-3)  # an absolute damping changes the step


def test_relative_damping_is_an_option_and_reports_its_fraction():
    model, _ = _problem()
    for cls in (KFAC, DiagGGNNewton):
        opt = cls(model.parameters(), lr=0.1, relative_damping=0.03)
        assert opt.defaults["damping"] is None and opt.damping() == 0.03
    assert RelativeDamping(0.1).of(0.0) == 1e-8  # a zero curvature: the least damping
    with pytest.raises(ValueError, match="relative_damping"):
        KFAC(model.parameters(), lr=0.1, relative_damping=-1.0)


def test_a_relative_damping_given_as_a_strategy_is_relative():
    """``damping=RelativeDamping(α)`` takes the steps of ``relative_damping=α``, not those of
    an absolute ``λ = α`` (as every damping given, with the curvature at every step unless
    ``curvature_interval`` says otherwise)."""
    runs = []
    for options in ({"damping": RelativeDamping(0.3)}, {"relative_damping": 0.3}, {"damping": 0.3}):
        model, lossfunc = _problem()
        opt = KFAC(
            model.parameters(), 0.1, curvature="kflr", kl_clip=None, curvature_interval=2, **options
        )
        runs.append(torch.cat([d.flatten() for d in _steps(opt, model, lossfunc, 3)[-1]]))
    torch.testing.assert_close(runs[0], runs[1], rtol=0, atol=0)
    assert not torch.allclose(runs[0], runs[2], rtol=1e-3)
    group = KFAC(model.parameters(), 0.1, RelativeDamping(0.3)).param_groups[0]
    assert opt._curvature_due(group, {"step": 1})  # a damping given: every step
