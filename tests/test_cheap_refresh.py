"""Cheap refreshes of the factors' eigenbases and inverses, and the precision chosen for the host.

* ``inversion.warm_eigh``: one power step from the last basis and a QR (SOAP's refresh), checked
  in float64 against ``torch.linalg.eigh``: an orthogonal basis always, its estimates
  ``diag(QᵀFQ)``, a fixed point at the exact basis, and repeated refreshes that converge to the
  exact eigenbasis of a factor with a gap; wired into ``EigenAdam`` and ``EKFAC``
  (``basis_refresh="warm"``), where the first refresh is exact;
* ``inversion.newton_root``: the coupled Newton iteration against ``torch.linalg.inv`` and the
  inverse roots of the eigendecomposition, with its error bound and step counts;
* ``orthogonalize_dtype="auto"``: picks bfloat16 or float32 by measurement, once per shape
  class, and steps as the fixed choice would.
"""

import io

import pytest
import torch
from torch import nn

import test_ekfac_accumulation as ekfac_accumulation

import curvopt
from curvopt.inversion.newton_root import newton_inverse_root
from curvopt.inversion.warm_eigh import eigenvalue_estimates, warm_eigenbasis
from curvopt.optim import EKFAC, KFAC, EigenAdam, orthogonalized
from curvopt.optim.one_sided import settled_eigenvectors
from curvopt.optim.stages import orthogonalize as orthogonalize_stage
from curvopt.optim.stages.eigenbasis import eigenbasis

DT = torch.float64
SEEDS = range(5)


def _orthogonal(dim, generator):
    return torch.linalg.qr(torch.randn(dim, dim, generator=generator, dtype=DT))[0]


def _factor(dim, generator, ratio=0.8):
    """``V diag(λ) Vᵀ`` with ``λ_i = ratio^i`` (every gap ``λ_{i+1}/λ_i = ratio``), and ``V``."""
    vectors = _orthogonal(dim, generator)
    values = ratio ** torch.arange(dim, dtype=DT)
    return vectors @ torch.diag(values) @ vectors.mT, vectors


def _off_diagonal(factor, basis):
    """``‖QᵀFQ − diag(QᵀFQ)‖_F / ‖F‖_F``."""
    rotated = basis.mT @ factor @ basis
    return float((rotated - torch.diag_embed(rotated.diagonal(dim1=-2, dim2=-1))).norm())


def _orthogonality(basis):
    eye = torch.eye(basis.shape[-1], dtype=basis.dtype)
    return float((basis.mT @ basis - eye).abs().max())


# ------------------------------------------------------------------------- warm eigenbasis
@pytest.mark.parametrize("seed", SEEDS)
def test_warm_refreshes_converge_to_the_exact_eigenbasis_of_a_factor_with_a_gap(seed):
    """Subspace iteration: from a random orthogonal start, 200 refreshes of a factor whose
    eigenvalue gaps are all 0.8 leave an off-diagonal mass below 1e-10 (the bound
    ``‖QᵀFQ − diag‖_F ≲ ‖F‖_F · 0.8ᵏ`` of docs/optim.md; 0.8²⁰⁰ ≈ 4e-20); each column is an
    exact eigenvector (``|q_iᵀ v_i| = 1`` to 1e-10) and the estimates are the eigenvalues."""
    generator = torch.Generator().manual_seed(seed)
    factor, vectors = _factor(8, generator)
    basis = _orthogonal(8, generator)
    errors = []
    for _ in range(200):
        basis = warm_eigenbasis(factor, basis)[1]
        errors.append(_off_diagonal(factor, basis) / float(factor.norm()))
        assert _orthogonality(basis) <= 1e-12
    assert errors[-1] <= 1e-10
    assert errors[50] <= 0.8**50 * 10 and errors[50] > errors[-1]  # not exact at once
    exact_values = torch.linalg.eigvalsh(factor).flip(0)  # descending, as the columns
    values = eigenvalue_estimates(factor, basis)
    torch.testing.assert_close(values, exact_values, rtol=1e-12, atol=1e-14)
    alignment = (basis.mT @ vectors).diagonal().abs()  # V's columns: λ descending
    torch.testing.assert_close(alignment, torch.ones(8, dtype=DT), rtol=0, atol=1e-10)


@pytest.mark.parametrize("seed", SEEDS)
def test_the_exact_eigenbasis_is_a_fixed_point_and_the_estimates_are_the_diagonal(seed):
    """From ``eigh``'s basis, a refresh returns the same columns (reordered by decreasing
    eigenvalue, signs kept); on any start the estimates are ``diag(QᵀFQ)`` of the new ``Q``."""
    generator = torch.Generator().manual_seed(seed)
    factor, _ = _factor(6, generator, ratio=0.6)
    exact_values, exact_basis = torch.linalg.eigh(factor)
    norms, basis = warm_eigenbasis(factor, exact_basis)
    torch.testing.assert_close(basis, exact_basis.flip(1), rtol=0, atol=1e-12)
    torch.testing.assert_close(norms, exact_values.flip(0), rtol=1e-12, atol=1e-14)
    values = eigenvalue_estimates(factor, basis)
    torch.testing.assert_close(values, exact_values.flip(0), rtol=1e-12, atol=1e-14)
    basis = warm_eigenbasis(factor, _orthogonal(6, generator))[1]
    values = eigenvalue_estimates(factor, basis)
    torch.testing.assert_close(values, (basis.mT @ factor @ basis).diagonal(), rtol=1e-12, atol=0)


@pytest.mark.parametrize("seed", SEEDS)
def test_the_basis_is_orthogonal_for_singular_and_stacked_factors(seed):
    """``‖QᵀQ − I‖ ≤ 1e-12`` where ``F`` is singular (a Gram of 3 rows, 7 wide; zero columns of
    ``F Q₀``) and for factors stacked per group, each refreshed as alone."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(3, 7, generator=generator, dtype=DT)
    basis = warm_eigenbasis(rows.mT @ rows, torch.eye(7, dtype=DT))[1]
    values = eigenvalue_estimates(rows.mT @ rows, basis)
    assert _orthogonality(basis) <= 1e-12 and bool((values >= -1e-12).all())
    stacked = torch.stack([_factor(5, generator)[0] for _ in range(3)])
    starts = torch.stack([_orthogonal(5, generator) for _ in range(3)])
    bases = warm_eigenbasis(stacked, starts)[1]
    values = eigenvalue_estimates(stacked, bases)
    for g in range(3):
        alone = warm_eigenbasis(stacked[g], starts[g])[1]
        torch.testing.assert_close(bases[g], alone, rtol=0, atol=1e-13)
        alone_values = eigenvalue_estimates(stacked[g], alone)
        torch.testing.assert_close(values[g], alone_values, rtol=1e-12, atol=1e-14)
        assert _orthogonality(bases[g]) <= 1e-12


def test_a_drifting_factor_is_tracked_within_its_drift():
    """A factor moving by 1e-4 (relative) per refresh, refreshed warm 100 times from its first
    exact basis: the off-diagonal mass stays below 1e-3 of ``‖F‖`` at every refresh."""
    generator = torch.Generator().manual_seed(0)
    factor, _ = _factor(10, generator, ratio=0.7)
    drift = torch.randn(10, 10, generator=generator, dtype=DT)
    drift = 1e-4 * float(factor.norm()) * (drift + drift.mT) / float((drift + drift.mT).norm())
    basis = torch.linalg.eigh(factor)[1]
    for _ in range(100):
        factor = factor + drift
        basis = warm_eigenbasis(factor, basis)[1]
        assert _off_diagonal(factor, basis) <= 1e-3 * float(factor.norm())


def test_the_stage_refreshes_warm_where_it_has_a_previous_basis():
    """``stages.eigenbasis.eigenbasis``: exact without a previous basis, warm with one, the
    identity (None) for a side wider than ``max_dim`` either way."""
    generator = torch.Generator().manual_seed(1)
    big, small = _factor(6, generator)[0], _factor(3, generator)[0]
    previous = [_orthogonal(6, generator), _orthogonal(3, generator)]
    exact = eigenbasis([big, small])
    torch.testing.assert_close(exact[1], torch.linalg.eigh(small)[1], rtol=0, atol=1e-12)
    warm = eigenbasis([big, small], None, previous)
    for side, factor, start in zip(warm, (big, small), previous):
        torch.testing.assert_close(side, warm_eigenbasis(factor, start)[1], rtol=0, atol=0)
    capped = eigenbasis([big, small], 4, previous)
    assert capped[0] is None
    torch.testing.assert_close(capped[1], warm[1], rtol=0, atol=0)


def _regression(seed=0):
    torch.manual_seed(seed)
    model = curvopt.extend(nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).to(DT))
    generator = torch.Generator().manual_seed(seed)
    X = torch.randn(32, 5, generator=generator, dtype=DT)
    y = torch.randn(32, 3, generator=generator, dtype=DT)
    return model, curvopt.extend(nn.MSELoss()), X, y


def _run(make, steps, seed=0):
    model, lossfunc, X, y = _regression(seed)
    opt = make(model.parameters())
    for _ in range(steps):
        opt.zero_grad()
        lossfunc(model(X), y).backward()
        opt.step()
    return model, opt


@pytest.mark.parametrize("seed", range(3))
def test_eigen_adam_warm_bases_start_exact_and_converge_on_fixed_factors(seed):
    """``EigenAdam(basis_refresh="warm")`` with ``lr=0`` (the factors stay fixed, ``kflr`` is
    exact, no average): the first refresh is ``eigh``'s basis bit for bit, the later ones are
    orthogonal and, refreshed every step, diagonalise the factors to 1e-8 after 150 steps."""

    def make(warm):
        refresh = "warm" if warm else "eigh"
        return lambda p: EigenAdam(
            p, lr=0.0, curvature="kflr", curvature_ema=0.0, basis_interval=1, basis_refresh=refresh
        )

    exact_model, exact = _run(make(False), 1, seed)
    model, warm = _run(make(True), 1, seed)
    for p, q in zip(model.parameters(), exact_model.parameters()):
        for side, exact_side in zip(warm.state[p]["eigenbasis"], exact.state[q]["eigenbasis"]):
            assert torch.equal(side, exact_side)
    model, warm = _run(make(True), 150, seed)
    for p in model.parameters():
        for side, factor in zip(warm.state[p]["eigenbasis"], p.kflr):
            assert _orthogonality(side) <= 1e-12
            assert _off_diagonal(factor, side) <= 1e-8 * float(factor.norm())


@pytest.mark.parametrize("seed", range(3))
def test_ekfac_warm_bases_start_exact_and_converge_on_fixed_factors(seed):
    """``EKFAC(basis_refresh="warm")``, ``lr=0``, a basis every step: the first refresh's bases
    are the exact (settled) eigenvectors, the later ones orthogonal and, after 150 steps,
    diagonalising the factors to 1e-8."""
    options = {"curvature": "kflr", "damping": 1e-3, "curvature_interval": 1, "kl_clip": None}

    def make(p):
        return EKFAC(p, lr=0.0, basis_refresh="warm", **options)

    model, opt = _run(make, 1, seed)
    for p in model.parameters():
        for side, factor in zip(opt.state[p]["bases_next"], p.kflr):
            assert torch.equal(side, settled_eigenvectors(factor))
    model, opt = _run(make, 150, seed)
    for p in model.parameters():
        for side, factor in zip(opt.state[p]["bases_next"], p.kflr):
            assert _orthogonality(side) <= 1e-12
            assert _off_diagonal(factor, side) <= 1e-8 * float(factor.norm())


@pytest.mark.parametrize("seed", range(3))
def test_warm_refreshes_train_as_exact_ones_do(seed):
    """On a noisy regression, ``EKFAC`` (default refresh interval) and ``EigenAdam`` (a basis
    every 2 steps) with warm refreshes lower the loss by 10 % or more in 30 steps and end within
    5 % of the loss their exact refreshes reach."""
    makers = {
        "ekfac": lambda p, r: EKFAC(p, lr=0.3, curvature="kflr", basis_refresh=r),
        "eigen_adam": lambda p, r: EigenAdam(p, lr=0.1, basis_interval=2, basis_refresh=r),
    }
    for make in makers.values():
        losses = {}
        for refresh in ("eigh", "warm"):
            model, lossfunc, X, y = _regression(seed)
            before = float(lossfunc(model(X), y).detach())
            model, _ = _run(lambda p, make=make, refresh=refresh: make(p, refresh), 30, seed)
            losses[refresh] = float(lossfunc(model(X), y).detach())
            assert losses[refresh] < 0.9 * before
        assert losses["warm"] <= 1.05 * losses["eigh"], losses


def test_warm_refresh_needs_the_last_refreshes_basis():
    with pytest.raises(ValueError, match="basis_source='last_refresh'"):
        EKFAC(nn.Linear(2, 2).parameters(), lr=0.1, basis_source="current", basis_refresh="warm")
    with pytest.raises(ValueError, match="basis_refresh must be one of"):
        EigenAdam(nn.Linear(2, 2).parameters(), basis_refresh="qr")


# ------------------------------------------------------------------------- coupled Newton
def _spd(dim, generator, condition):
    vectors = _orthogonal(dim, generator)
    values = torch.logspace(0, -torch.log10(torch.tensor(condition)).item(), dim, dtype=DT)
    return vectors @ torch.diag(values) @ vectors.mT, vectors, values


@pytest.mark.parametrize("seed", SEEDS)
def test_newton_inverse_meets_its_error_bound_in_few_steps(seed):
    """``p = 1``: ``‖X − A⁻¹‖ / ‖A⁻¹‖ ≤ ‖XA − I‖_F ≤ tolerance`` against ``torch.linalg.inv``,
    a cold start within ``log₂ κ + 8`` steps; from the inverse of ``A`` before it moved to
    ``A^(1/2) (I + E) A^(1/2)``, ``‖E‖_F = 0.02`` (a warm start), within 3 steps."""
    generator = torch.Generator().manual_seed(seed)
    matrix, vectors, values = _spd(12, generator, condition=1e3)
    exact = torch.linalg.inv(matrix)
    inverse, steps = newton_inverse_root(matrix, tolerance=1e-10)
    assert float((inverse - exact).norm() / exact.norm()) <= 1e-10
    assert steps <= 10 + 8
    root = vectors @ torch.diag(values.sqrt()) @ vectors.mT
    turn = torch.randn(12, 12, generator=generator, dtype=DT)
    turn = 0.02 * (turn + turn.mT) / (turn + turn.mT).norm()
    moved = root @ (torch.eye(12, dtype=DT) + turn) @ root
    warm, warm_steps = newton_inverse_root(moved, previous=inverse, tolerance=1e-10)
    reference = torch.linalg.inv(moved)
    assert float((warm - reference).norm() / reference.norm()) <= 1e-10
    assert warm_steps <= 3 < steps


@pytest.mark.parametrize("root", [2, 4])
@pytest.mark.parametrize("seed", range(3))
def test_newton_inverse_roots_match_the_eigendecomposition(root, seed):
    """``A^(-1/p)`` to ``tolerance`` (relative, first order ``‖M − I‖ / p``) against
    ``V diag(λ^(-1/p)) Vᵀ``, and symmetric."""
    generator = torch.Generator().manual_seed(seed)
    matrix, vectors, values = _spd(10, generator, condition=1e2)
    exact = vectors @ torch.diag(values ** (-1 / root)) @ vectors.mT
    result, steps = newton_inverse_root(matrix, root=root, tolerance=1e-11)
    assert float((result - exact).norm() / exact.norm()) <= 1e-11
    assert torch.equal(result, result.mT) and steps <= 30


def test_newton_inverse_in_low_precision_is_rounded_but_close():
    """Products in float32 on a well-conditioned float64 matrix: the result (float64) is within
    1e-5 of the inverse, not exact."""
    generator = torch.Generator().manual_seed(0)
    matrix, _, _ = _spd(16, generator, condition=10.0)
    exact = torch.linalg.inv(matrix)
    inverse, _ = newton_inverse_root(matrix, dtype=torch.float32, tolerance=1e-5)
    error = float((inverse - exact).norm() / exact.norm())
    assert inverse.dtype == DT and 1e-12 < error <= 1e-5


@pytest.mark.parametrize(
    "matrix, root, match",
    [
        (torch.eye(2), 0, "root must be an int >= 1"),
        (torch.ones(2, 3), 1, "must be square"),
        (torch.tensor([[1.0, float("nan")], [0.0, 1.0]]), 1, "non-finite"),
        (torch.eye(2), 2, "warm start"),
    ],
)
def test_newton_inverse_refuses_bad_input(matrix, root, match):
    previous = torch.eye(2) if match == "warm start" else None
    with pytest.raises(ValueError, match=match):
        newton_inverse_root(matrix, root=root, previous=previous)


# ------------------------------------------------------------------------- precision per host
def _orthogonalized_run(dtype, steps=3):
    torch.manual_seed(0)
    model = curvopt.extend(
        nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    )
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    generator = torch.Generator().manual_seed(0)
    X, y = torch.randn(16, 6, generator=generator), torch.randint(0, 3, (16,), generator=generator)
    opt = KFAC(
        model.parameters(), lr=0.1, damping=0.1, orthogonalize=True, orthogonalize_dtype=dtype
    )
    for _ in range(steps):
        opt.zero_grad()
        lossfunc(model(X), y).backward()
        opt.step()
    return model, opt


def test_auto_measures_once_per_shape_class_and_steps_as_its_choice(monkeypatch):
    """``orthogonalize_dtype="auto"``: the three weights (8×6, 8×8, 3×8) fall in two shape
    classes (8×8 and 4×8 after rounding up), so over three steps the measurement runs twice; every
    weight's state names a dtype of the set, and the parameters are those of a run with that
    dtype fixed, bit for bit."""
    calls = []
    measure = orthogonalize_stage.faster_dtype
    monkeypatch.setattr(
        orthogonalize_stage, "faster_dtype", lambda m: calls.append(m.shape) or measure(m)
    )
    model, opt = _orthogonalized_run("auto")
    assert len(calls) == 2
    chosen = {opt.state[p]["orthogonalize_dtype"] for p in model.parameters() if p.dim() == 2}
    assert chosen <= {torch.bfloat16, torch.float32}
    if len(chosen) == 1:  # one dtype for every class: the fixed run is the same
        fixed, _ = _orthogonalized_run(chosen.pop())
        for p, q in zip(model.parameters(), fixed.parameters()):
            assert torch.equal(p, q)


def test_auto_forced_to_each_dtype_steps_as_that_dtype(monkeypatch):
    """With the measurement answering a given dtype, ``"auto"`` equals that fixed dtype."""
    for dtype in orthogonalize_stage.AUTO_CANDIDATES:
        monkeypatch.setattr(orthogonalize_stage, "faster_dtype", lambda m, d=dtype: d)
        auto, _ = _orthogonalized_run("auto")
        fixed, _ = _orthogonalized_run(dtype)
        for p, q in zip(auto.parameters(), fixed.parameters()):
            assert torch.equal(p, q)


def test_faster_dtype_times_each_candidate_and_picks_one():
    """The measurement itself: one of the set, and Newton–Schulz in it is what the step runs."""
    matrix = torch.randn(16, 12, generator=torch.Generator().manual_seed(0))
    dtype = orthogonalize_stage.faster_dtype(matrix, rounds=1)
    assert dtype in (torch.bfloat16, torch.float32)
    assert orthogonalized(matrix, dtype=dtype).shape == matrix.shape


def test_auto_is_a_valid_option_and_other_strings_are_not():
    KFAC(nn.Linear(2, 2).parameters(), 0.1, orthogonalize=True, orthogonalize_dtype="auto")
    with pytest.raises(ValueError, match="or 'auto'"):
        KFAC(nn.Linear(2, 2).parameters(), 0.1, orthogonalize=True, orthogonalize_dtype="fast")


def test_a_loaded_state_dict_keeps_the_choice_and_does_not_measure_again(monkeypatch):
    """The chosen dtype lives in the parameters' state: an optimizer loading the state (saved and
    loaded with ``weights_only=True``) steps with it and measures nothing."""
    monkeypatch.setattr(orthogonalize_stage, "faster_dtype", lambda m: torch.bfloat16)
    model, opt = _orthogonalized_run("auto", steps=1)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    twin = KFAC(
        model.parameters(), lr=0.1, damping=0.1, orthogonalize=True, orthogonalize_dtype="auto"
    )
    twin.load_state_dict(torch.load(buffer, weights_only=True))
    monkeypatch.setattr(orthogonalize_stage, "faster_dtype", _never_measured)
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    generator = torch.Generator().manual_seed(0)
    X, y = torch.randn(16, 6, generator=generator), torch.randint(0, 3, (16,), generator=generator)
    twin.zero_grad()
    lossfunc(model(X), y).backward()
    twin.step()
    names = {twin.state[p]["orthogonalize_dtype"] for p in model.parameters() if p.dim() == 2}
    assert names == {torch.bfloat16}


def _never_measured(matrix):
    raise AssertionError("measured again after loading the state")


@pytest.mark.parametrize("curvature", ["kflr", "kfac"])
@pytest.mark.parametrize("problem", ["gpt", "mlp"])
def test_warm_bases_keep_ekfac_under_accumulation_one_batch(problem, curvature):
    """A warm refresh starts from the last basis and the window's summed factors, both the same
    for micro-batches and one batch: 2 micro-batches take one batch's 4 steps (a basis at every
    step, three of them warm) to 1e-12, without a warning."""
    options = {"curvature": curvature, "basis_refresh": "warm"}
    start, one, _ = ekfac_accumulation._train(problem, "mean", 1, steps=4, **options)
    _, two, warned = ekfac_accumulation._train(problem, "mean", 2, steps=4, **options)
    moved = (one - start).norm()
    assert moved > 1e-3
    assert (two - one).norm() <= 1e-12 * moved, float((two - one).norm() / moved)
    assert not warned


@pytest.mark.parametrize(
    "bfloat16_seconds, chosen",
    [(0.5, torch.bfloat16), (1 / 1.5, torch.bfloat16), (0.7, torch.float32), (2.0, torch.float32)],
)
def test_bfloat16_is_chosen_only_where_clearly_faster(monkeypatch, bfloat16_seconds, chosen):
    """Timings are noisy near the crossover: bfloat16 must beat float32's time (1 s here) by
    ``BFLOAT16_MARGIN`` (1.5x), else the class keeps float32 whatever the noise says."""
    seconds = {torch.bfloat16: bfloat16_seconds, torch.float32: 1.0}
    monkeypatch.setattr(orthogonalize_stage, "_timed", lambda matrix, dtype: seconds[dtype])
    assert orthogonalize_stage.faster_dtype(torch.ones(4, 4)) is chosen
