"""``orthogonalize=True`` (``stages.orthogonalize``): each matrix-shaped update replaced by its
polar factor by Newton–Schulz (``optim.orthogonalized``), Kronecker preconditioning followed
by orthogonalisation. Checked in float64 against the singular value decomposition written out,
against the step it transforms, and against ``torch.optim.Muon``, which it equals where the
curvature is negligible."""

import copy

import pytest
import torch
from torch import nn

import curvopt
from curvopt.optim import KFAC, DiagGGNNewton, orthogonalized
from curvopt.optim.transforms import NEWTON_SCHULZ

DT = torch.float64


def _through_singular_values(matrix, steps=5):
    """The same map from the SVD: each normalised singular value through the scalar quintic."""
    u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
    a, b, c = NEWTON_SCHULZ
    s = s / matrix.norm()
    for _ in range(steps):
        s = a * s + b * s**3 + c * s**5
    return u @ torch.diag(s) @ vh


@pytest.mark.parametrize("shape", [(5, 5), (3, 8), (8, 3), (1, 6), (7, 1)])
def test_orthogonalized_maps_the_singular_values_and_keeps_the_vectors(shape):
    g = torch.Generator().manual_seed(sum(shape))
    matrix = torch.randn(*shape, generator=g, dtype=DT) * 30
    out = orthogonalized(matrix)
    torch.testing.assert_close(out, _through_singular_values(matrix), rtol=1e-10, atol=1e-12)
    s = torch.linalg.svdvals(out)
    assert bool(((s > 0.6) & (s < 1.3)).all())  # near the polar factor, as Muon's iteration
    assert not torch.equal(out, matrix) and matrix.abs().max() > 1  # a new tensor


def _model(conv: bool):
    torch.manual_seed(0)
    if conv:
        layers = [nn.Conv2d(2, 4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(16, 3)]
    else:
        layers = [nn.Linear(4, 9), nn.Tanh(), nn.Linear(9, 3)]
    return curvopt.extend(nn.Sequential(*layers).to(DT))


def _data(conv: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    shape = (6, 2, 4, 4) if conv else (6, 4)
    return torch.randn(*shape, generator=g, dtype=DT), torch.randint(0, 3, (6,), generator=g)


def _step(conv, make, seed=1):
    model, lossfunc = _model(conv), curvopt.extend(nn.CrossEntropyLoss())
    opt = make(model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    X, y = _data(conv, seed)
    lossfunc(model(X), y).backward()
    opt.step()
    return [b - p.detach() for b, p in zip(before, model.parameters())]


@pytest.mark.parametrize("conv", [False, True])
@pytest.mark.parametrize("name", ["KFAC", "DiagGGNNewton"])
def test_the_step_is_the_polar_factor_of_the_preconditioned_one(name, conv):
    """``Δ = lr · √max(1, m/n) · polar(D)`` for a weight ``[m, n, *k]`` whose step without the
    stage is ``D`` (``lr = 1``); a bias keeps ``lr · D``."""
    cls = {"KFAC": KFAC, "DiagGGNNewton": DiagGGNNewton}[name]
    options = {"damping": 0.1, "kl_clip": None}
    plain = _step(conv, lambda p: cls(p, lr=1.0, **options))
    ortho = _step(conv, lambda p: cls(p, lr=0.3, orthogonalize=True, **options))
    for d, delta in zip(plain, ortho):
        if d.dim() < 2:
            torch.testing.assert_close(delta, 0.3 * d, rtol=1e-12, atol=1e-14)
            continue
        m = d.reshape(d.shape[0], -1)
        scale = max(1.0, m.shape[0] / m.shape[1]) ** 0.5
        want = 0.3 * scale * _through_singular_values(m)
        torch.testing.assert_close(delta.reshape(m.shape), want, rtol=1e-9, atol=1e-12)


def _errors_against_muon(widths, batch, **options) -> list[float]:
    """Three steps of ``torch.optim.Muon`` (lr 0.02, momentum 0.9, no Nesterov, no weight decay)
    and of ``KFAC(orthogonalize=True, **options)`` with negligible curvature (damping 1e12, no
    trust region) on twin bias-free MLPs of ``widths``, on the same random batches of ``batch``
    samples: each weight's relative distance between the two moves."""
    torch.manual_seed(0)
    layers = []
    for fan_in, fan_out in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(fan_in, fan_out, bias=False), nn.Tanh()]
    model = nn.Sequential(*layers[:-1])
    twin = curvopt.extend(copy.deepcopy(model))
    start = [p.detach().clone() for p in model.parameters()]
    muon = torch.optim.Muon(
        model.parameters(), lr=0.02, weight_decay=0.0, momentum=0.9, nesterov=False
    )
    ours = KFAC(
        twin.parameters(),
        lr=0.02,
        damping=1e12,
        kl_clip=None,
        momentum=0.9,
        orthogonalize=True,
        **options,
    )
    losses = (nn.CrossEntropyLoss(), curvopt.extend(nn.CrossEntropyLoss()))
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        X = torch.randn(batch, widths[0], generator=g)
        y = torch.randint(0, widths[-1], (batch,), generator=g)
        for net, opt, lossfunc in zip((model, twin), (muon, ours), losses):
            opt.zero_grad()
            lossfunc(net(X), y).backward()
            opt.step()
    errors = []
    for p, q, s in zip(model.parameters(), twin.parameters(), start):
        moved, ours_moved = p.detach() - s, q.detach() - s
        errors.append(float((moved - ours_moved).norm() / moved.norm()))
    return errors


def test_with_negligible_curvature_it_is_torchs_muon(monkeypatch):
    """Damping 1e12 makes ``D`` the gradient up to a scale (to 1e-6): the steps, with
    momentum, are ``torch.optim.Muon``'s (no Nesterov, no weight decay), to float32's rounding,
    with Muon's Newton–Schulz iteration run in float64 (through the singular values). Muon's
    own runs in bfloat16, whose rounding the iteration amplifies (up to 25 % of a 3 x 10
    layer's step here), so that is not compared."""

    def in_float64(grad, coefficients, steps, eps):
        assert tuple(coefficients) == NEWTON_SCHULZ and steps == 5  # Muon's defaults are ours
        return _through_singular_values(grad.double(), steps).to(grad.dtype)

    monkeypatch.setattr(torch.optim._muon, "_zeropower_via_newtonschulz", in_float64)
    errors = _errors_against_muon((6, 10, 3), 8)
    assert max(errors) < 1e-4, errors


def test_orthogonalized_in_bfloat16_is_near_the_exact_map_and_keeps_the_dtype():
    """``dtype=torch.bfloat16`` (Muon's): the iterations' rounding (relative ``2⁻⁸`` per
    product) stays within a few per cent of the float64 map on a 64 x 24 matrix, and the result
    has the input's dtype."""
    g = torch.Generator().manual_seed(5)
    matrix = torch.randn(64, 24, generator=g, dtype=DT)
    out = orthogonalized(matrix, dtype=torch.bfloat16)
    assert out.dtype == DT
    exact = _through_singular_values(matrix)
    error = float((out - exact).norm() / exact.norm())
    assert 1e-6 < error < 0.03, error  # rounded (not computed in float64), but close


@pytest.mark.parametrize("dtype", [torch.bfloat16, "bfloat16", torch.float32])
def test_the_step_computes_newton_schulz_in_orthogonalize_dtype(dtype):
    """``orthogonalize_dtype`` (a dtype or its name): the matrices' steps are
    ``lr · √max(1, m/n) · orthogonalized(D, dtype=...)``, in the parameters' dtype, and not
    the float64 map (DiagGGN-Newton: its ``D`` has the weights' layout, so the products take
    the same kernels as here); the biases' steps stay exact."""
    options = {"damping": 0.1, "kl_clip": None}
    plain = _step(False, lambda p: DiagGGNNewton(p, lr=1.0, **options))
    ortho = _step(
        False,
        lambda p: DiagGGNNewton(
            p, lr=0.3, orthogonalize=True, orthogonalize_dtype=dtype, **options
        ),
    )
    as_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    for d, delta in zip(plain, ortho):
        assert delta.dtype == DT
        if d.dim() < 2:
            torch.testing.assert_close(delta, 0.3 * d, rtol=1e-12, atol=1e-14)
            continue
        scale = 0.3 * max(1.0, d.shape[0] / d.shape[1]) ** 0.5
        want = scale * orthogonalized(d, dtype=as_dtype)
        torch.testing.assert_close(delta, want, rtol=1e-12, atol=1e-14)
        exact = scale * _through_singular_values(d)
        assert float((delta - exact).norm() / exact.norm()) > 1e-8  # rounded in the dtype


def test_in_bfloat16_it_is_torchs_muon_with_its_own_iteration():
    """With negligible curvature and ``orthogonalize_dtype=torch.bfloat16`` the steps are
    ``torch.optim.Muon``'s own (unpatched, bfloat16) to the rounding of bfloat16 products
    taken in another order: within 5 % on 32 -> 48 -> 40 layers (2-3 % seen), where a wrong
    scale, transpose or momentum would be off by far more."""
    errors = _errors_against_muon((32, 48, 40), 64, orthogonalize_dtype=torch.bfloat16)
    assert max(errors) < 0.05, errors


@pytest.mark.parametrize("bad", ["int8", torch.int32, torch.complex64, 16, True])
def test_orthogonalize_dtype_must_be_a_floating_dtype_newton_schulz_runs_in(bad):
    with pytest.raises(ValueError, match="orthogonalize_dtype must be None or one of"):
        KFAC(nn.Linear(2, 2).parameters(), 0.1, orthogonalize=True, orthogonalize_dtype=bad)


def test_orthogonalize_is_a_flag():
    with pytest.raises(ValueError, match="orthogonalize must be True or False"):
        KFAC(nn.Linear(2, 2).parameters(), 0.1, orthogonalize=1)
