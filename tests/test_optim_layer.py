"""Tests of the damping-and-inversion layer of ``curvopt.optim``: dense float64 references."""

import math

import pytest
import torch

from curvopt.optim import (
    ConstantDamping,
    LevenbergMarquardt,
    ScheduledDamping,
    add_weight_decay,
    as_damping,
    as_matrix,
    cached,
    cholesky_factor,
    cholesky_inverse,
    cholesky_solve_right,
    diag_precondition,
    diag_quadratic,
    ema,
    exact_damped_solve,
    kl_clip_factor,
    kron_cholesky_solve,
    kron_eigh,
    kron_matmul,
    kron_quadratic,
    momentum,
    psd_eigh,
    reduction_ratio,
    trace_norm_cholesky,
    trace_norm_damped,
    trace_norm_inverse,
    trace_norm_pi,
)

DT = torch.float64


def spd(d, seed, rank=None, scale=1.0):
    """A random symmetric PSD ``[d, d]`` matrix of the given rank (full by default)."""
    gen = torch.Generator().manual_seed(seed)
    root = torch.randn(d, rank or d, generator=gen, dtype=DT)
    return scale * root @ root.T / (rank or d)


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DT)


# ----------------------------------------------------------------------------- damping strategies


def test_constant_and_scheduled_damping():
    constant = as_damping(0.1)
    assert isinstance(constant, ConstantDamping)
    assert constant.value(constant.init(), 7) == 0.1
    schedule = as_damping(lambda t: 1.0 / (t + 1))
    assert isinstance(schedule, ScheduledDamping)
    assert schedule.value({}, 3) == 0.25
    strategy = LevenbergMarquardt(1.0)
    assert as_damping(strategy) is strategy


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf, "1e-3", None, True])
def test_invalid_damping_rejected(bad):
    with pytest.raises(ValueError):
        as_damping(bad)


def test_schedule_returning_negative_damping_raises():
    with pytest.raises(ValueError, match="damping schedule"):
        ScheduledDamping(lambda t: -1.0).value({}, 0)


def test_levenberg_marquardt_rule():
    lm = LevenbergMarquardt(1.0, omega=2.0, interval=1, min_damping=0.25, max_damping=4.0)
    state = lm.init()
    assert lm.value(state, 0) == 1.0
    state = lm.update(state, 0.1)  # rho < 1/4: model too optimistic, damp more
    assert lm.value(state, 1) == 2.0
    state = lm.update(state, 0.5)  # 1/4 <= rho <= 3/4: unchanged
    assert lm.value(state, 2) == 2.0
    state = lm.update(state, 0.9)  # rho > 3/4: trust the model, damp less
    assert lm.value(state, 3) == 1.0
    state = lm.update(state, math.nan)  # undefined: unchanged
    assert lm.value(state, 4) == 1.0
    for _ in range(5):
        state = lm.update(state, -math.inf)
    assert lm.value(state, 5) == 4.0  # clipped at max_damping
    for _ in range(5):
        state = lm.update(state, 1.0)
    assert lm.value(state, 6) == 0.25  # clipped at min_damping
    assert LevenbergMarquardt(1.0, interval=5).omega == pytest.approx((20 / 19) ** 5)


@pytest.mark.parametrize(
    "kwargs", [{"omega": 1.0}, {"interval": 0}, {"min_damping": 2.0}, {"max_damping": 0.5}]
)
def test_levenberg_marquardt_rejects_bad_options(kwargs):
    with pytest.raises(ValueError):
        LevenbergMarquardt(1.0, **kwargs)


def test_reduction_ratio():
    assert reduction_ratio(-1.0, -2.0) == 0.5
    assert math.isnan(reduction_ratio(-1.0, 0.0))  # no predicted decrease: undefined
    assert math.isnan(reduction_ratio(-1.0, 1.0))
    assert reduction_ratio(math.nan, -1.0) == -math.inf  # the loss blew up: failed step
    assert reduction_ratio(1.0, -1.0) == -1.0


# ----------------------------------------------------------------------------- inversion


def test_cholesky_inverse_matches_dense_inverse():
    matrix = spd(6, 0) + 0.1 * torch.eye(6, dtype=DT)
    torch.testing.assert_close(cholesky_inverse(matrix), torch.linalg.inv(matrix))


def near_singular_float32():
    """A float32 SPD matrix whose float32 Cholesky fails while its float64 Cholesky succeeds.

    Spectrum 1 ... 1e-9 rounded to float32: about one seed in five qualifies.
    """
    for seed in range(200):
        gen = torch.Generator().manual_seed(seed)
        basis, _ = torch.linalg.qr(torch.randn(4, 4, generator=gen, dtype=DT))
        matrix = ((basis * torch.logspace(0, -9, 4, dtype=DT)) @ basis.T).float()
        matrix = (matrix + matrix.T) / 2
        fails32 = torch.linalg.cholesky_ex(matrix)[1] != 0
        works64 = torch.linalg.cholesky_ex(matrix.double())[1] == 0
        if fails32 and works64:
            return matrix
    pytest.fail("no near-singular float32 test matrix found")


def test_cholesky_inverse_retries_in_float64():
    matrix = near_singular_float32()
    inverse = cholesky_inverse(matrix)
    assert inverse.dtype == torch.float32
    expected = torch.linalg.inv(matrix.double()).float()
    torch.testing.assert_close(inverse, expected, rtol=1e-4, atol=0)


def test_cholesky_inverse_raises_for_indefinite_matrix():
    with pytest.raises(torch.linalg.LinAlgError, match="increase the damping"):
        cholesky_inverse(-torch.eye(3, dtype=DT))


def test_psd_eigh_recomputes_a_silently_failed_float32_solve_in_float64(monkeypatch):
    """LAPACK's float32 eigh returned NaN without raising for MNIST logreg's input factor at one
    thread; a non-finite float32 result is recomputed in float64 (here the failure is forced)."""
    torch.manual_seed(0)
    root = torch.randn(5, 8)
    matrix = root.T @ root
    eigh = torch.linalg.eigh

    def failing_in_float32(m):
        values, vectors = eigh(m)
        if m.dtype == torch.float32:
            return torch.full_like(values, float("nan")), vectors
        return values, vectors

    monkeypatch.setattr(torch.linalg, "eigh", failing_in_float32)
    values, vectors = psd_eigh(matrix)
    assert values.dtype == torch.float32 and bool(values.isfinite().all())
    torch.testing.assert_close(vectors @ torch.diag(values) @ vectors.T, matrix, atol=1e-4, rtol=0)
    with pytest.raises(torch.linalg.LinAlgError, match="non-finite entries"):
        psd_eigh(torch.full((3, 3), float("nan")))


def test_psd_eigh_deflates_zero_rows_exactly():
    """An input feature that is always 0 (MNIST's border pixels) gives a zero row and column:
    its unit vector with eigenvalue 0, and the eigenpairs of the rest, in ascending order."""
    torch.manual_seed(0)
    root = torch.randn(3, 6, dtype=torch.float64)
    root[:, [1, 4]] = 0
    matrix = root.T @ root
    values, vectors = psd_eigh(matrix)
    torch.testing.assert_close(vectors @ torch.diag(values) @ vectors.T, matrix)
    torch.testing.assert_close(vectors.T @ vectors, torch.eye(6, dtype=torch.float64))
    assert bool((values[1:] >= values[:-1]).all())
    assert torch.equal(vectors[[1, 4]][:, :2], torch.eye(2, dtype=torch.float64))


def test_psd_eigh_clips_round_off():
    matrix = spd(5, 1, rank=2)
    values, vectors = psd_eigh(matrix)
    assert (values >= 0).all()
    torch.testing.assert_close(vectors @ torch.diag(values) @ vectors.T, matrix)


def test_cached_recomputes_only_when_due_and_changed():
    calls = []

    def compute():
        calls.append(1)
        return len(calls)

    entry = cached(None, key=0, step=0, interval=3, compute=compute)
    assert entry["value"] == 1
    assert cached(entry, key=1, step=2, interval=3, compute=compute) is entry  # not due
    assert cached(entry, key=0, step=9, interval=3, compute=compute) is entry  # unchanged
    entry = cached(entry, key=1, step=3, interval=3, compute=compute)
    assert entry == {"value": 2, "key": 1, "step": 3}


# ----------------------------------------------------------------------------- Kronecker


@pytest.fixture
def kron_case():
    out, inp = 3, 4
    return spd(out, 2, scale=3.0), spd(inp, 3, scale=0.5), rand(out, inp, seed=4)


def test_kron_matmul_is_kronecker_product(kron_case):
    B, A, G = kron_case
    expected = torch.kron(B, A) @ G.flatten()
    torch.testing.assert_close(kron_matmul([B, A], G).flatten(), expected)
    torch.testing.assert_close(kron_quadratic([B, A], G), G.flatten() @ expected)
    bias = rand(3, seed=5)
    torch.testing.assert_close(kron_matmul([B], as_matrix(bias, [B])).flatten(), B @ bias)


def test_as_matrix_shapes():
    B, A = torch.eye(5), torch.eye(3 * 2 * 2)
    assert as_matrix(torch.zeros(5, 3, 2, 2), [B, A]).shape == (5, 12)
    assert as_matrix(torch.zeros(5), [B]).shape == (5, 1)
    with pytest.raises(ValueError, match="do not match"):
        as_matrix(torch.zeros(5, 4), [B, A])


def test_trace_norm_damping_matches_dense_form(kron_case):
    B, A, G = kron_case
    lam = 0.3
    pi = math.sqrt((A.trace() / 4) / (B.trace() / 3))
    assert trace_norm_pi([B, A]).item() == pytest.approx(pi)
    dense = torch.kron(
        B + math.sqrt(lam) / pi * torch.eye(3, dtype=DT),
        A + pi * math.sqrt(lam) * torch.eye(4, dtype=DT),
    )
    torch.testing.assert_close(torch.kron(*trace_norm_damped([B, A], lam)), dense)
    result = kron_matmul(trace_norm_inverse([B, A], lam), G)
    torch.testing.assert_close(result.flatten(), torch.linalg.solve(dense, G.flatten()))


def test_trace_norm_damping_of_a_bias_is_plain(kron_case):
    B, _, _ = kron_case
    g = rand(3, 1, seed=6)
    expected = torch.linalg.solve(B + 0.3 * torch.eye(3, dtype=DT), g)
    torch.testing.assert_close(kron_matmul(trace_norm_inverse([B], 0.3), g), expected)


def test_trace_norm_with_zero_factors_is_lambda_identity():
    zero = [torch.zeros(3, 3, dtype=DT), torch.zeros(2, 2, dtype=DT)]
    assert trace_norm_pi(zero).item() == 1.0
    torch.testing.assert_close(
        torch.kron(*trace_norm_damped(zero, 0.5)), 0.5 * torch.eye(6, dtype=DT)
    )


@pytest.mark.parametrize("lam", [1e-3, 0.3, 10.0])
def test_exact_damping_matches_dense_inverse(kron_case, lam):
    B, A, G = kron_case
    dense = torch.kron(B, A) + lam * torch.eye(12, dtype=DT)
    expected = torch.linalg.inv(dense) @ G.flatten()
    result = exact_damped_solve(kron_eigh([B, A]), G, lam)
    torch.testing.assert_close(result.flatten(), expected)


def test_exact_damping_of_low_rank_factors_and_a_bias():
    B, A = spd(3, 7, rank=1), spd(4, 8, rank=2)
    G = rand(3, 4, seed=9)
    dense = torch.kron(B, A) + 0.01 * torch.eye(12, dtype=DT)
    torch.testing.assert_close(
        exact_damped_solve(kron_eigh([B, A]), G, 0.01).flatten(),
        torch.linalg.solve(dense, G.flatten()),
    )
    g = rand(3, 1, seed=10)
    torch.testing.assert_close(
        exact_damped_solve(kron_eigh([B]), g, 0.01),
        torch.linalg.solve(B + 0.01 * torch.eye(3, dtype=DT), g),
    )


# ----------------------------------------------------------------------------- diagonal, transforms


def test_diag_precondition_and_quadratic():
    g, c, s = rand(5, seed=11), rand(5, seed=12).abs(), rand(5, seed=13)
    dense = torch.diag(c) + 0.1 * torch.eye(5, dtype=DT)
    torch.testing.assert_close(diag_precondition(g, c, 0.1), torch.linalg.solve(dense, g))
    torch.testing.assert_close(diag_quadratic(c, s), s @ torch.diag(c) @ s)


def test_ema_over_tensors_and_factor_lists():
    old, new = rand(3, seed=14), rand(3, seed=15)
    torch.testing.assert_close(ema(old, new, 0.9), 0.9 * old + 0.1 * new)
    assert ema(None, new, 0.9) is new
    factors = ema([old, 2 * old], [new, 2 * new], 0.5)
    torch.testing.assert_close(factors[1], old + new)


def test_weight_decay_and_momentum():
    g, p = rand(4, seed=16), rand(4, seed=17)
    torch.testing.assert_close(add_weight_decay(g, p, 0.1), g + 0.1 * p)
    assert add_weight_decay(g, p, 0.0) is g
    v = momentum(None, g, 0.9)
    torch.testing.assert_close(v, g)
    v2 = momentum(v, p, 0.9)
    torch.testing.assert_close(v2, 0.9 * g + p)
    torch.testing.assert_close(v, g)  # inputs are not modified


def test_kl_clip_factor():
    g, d = [rand(3, seed=18)], [rand(3, seed=18) * 4]  # sum g*d = 4 |g|^2
    total = float((g[0] * d[0]).sum()) * 0.1**2
    assert kl_clip_factor(g, d, lr=0.1, kl_clip=total / 4) == pytest.approx(0.5)
    assert kl_clip_factor(g, d, lr=0.1, kl_clip=total * 10) == 1.0
    assert kl_clip_factor([torch.zeros(3)], [torch.zeros(3)], lr=0.1, kl_clip=1e-3) == 1.0


# ----------------------------------------------------------------------------- Cholesky solves


def test_trace_norm_cholesky_solve_matches_dense_solve_and_inverses(kron_case):
    B, A, G = kron_case
    for factors, matrix in (([B, A], G), ([B], rand(3, 1, seed=20))):
        damped = trace_norm_damped(factors, 0.3)
        dense = torch.kron(*damped) if len(damped) == 2 else damped[0]
        cholesky = trace_norm_cholesky(factors, 0.3)
        for L, M in zip(cholesky, damped):
            assert torch.equal(L, L.tril())
            torch.testing.assert_close(L @ L.T, M)
        result = kron_cholesky_solve(cholesky, matrix)
        torch.testing.assert_close(result.flatten(), torch.linalg.solve(dense, matrix.flatten()))
        torch.testing.assert_close(result, kron_matmul(trace_norm_inverse(factors, 0.3), matrix))


def test_cholesky_solve_right_is_product_with_inverse():
    matrix = spd(5, 21) + 0.1 * torch.eye(5, dtype=DT)
    X = rand(3, 5, seed=22)
    expected = X @ torch.linalg.inv(matrix)
    torch.testing.assert_close(cholesky_solve_right(X, cholesky_factor(matrix)), expected)


def test_cholesky_factor_retries_in_float64_and_raises_when_indefinite():
    matrix = near_singular_float32()
    factor = cholesky_factor(matrix)
    assert factor.dtype == torch.float32
    product = factor.double() @ factor.double().T
    torch.testing.assert_close(product, matrix.double(), rtol=0, atol=1e-6)
    with pytest.raises(torch.linalg.LinAlgError, match="increase the damping"):
        cholesky_factor(-torch.eye(3, dtype=DT))
