"""What makes ``EKFAC``'s defaults cheaper, each checked in float64 against the computation it
replaces:

* a refresh decomposes each distinct factor once (``one_sided.Refresh``): a layer's bias has its
  weight's output-side factor, so it takes the weight's basis, the bits a second
  decomposition of the same matrix gives;
* the trust region (``trust_metric="ggn"``) reads the solve's coordinates in the basis
  (``Q_Bᵀ D Q_A``, ``inversion.eigen_corrected.eigen_corrected_coordinates``) instead of rotating
  the direction again: the steps of a twin that rotates it (a stage between the preconditioning
  and the trust region, which makes the optimizer measure the direction itself) to 1e-12;
* a warm refresh's power step ``F Q`` gives the trust region's ``diag(Qᵀ F Q)`` too: bit for
  bit the steps of forming it twice;
* ``basis_interval=None`` (the default) is every third curvature step under the default
  damping and every one with a damping given, bit for bit the steps of the interval named;
* ``basis_refresh=None`` (the default) is ``"warm"`` under the default damping and ``"eigh"``
  with a damping (or a relative damping) given, bit for bit the steps of the option named.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import curvopt
from curvopt.inversion.eigen_corrected import basis_eigenvalues
from curvopt.inversion.warm_eigh import power_step, warm_eigenbasis
from curvopt.optim import EKFAC
from curvopt.optim import ekfac as ekfac_module
from curvopt.optim.ekfac import basis_interval, basis_refresh
from curvopt.optim.one_sided import Refresh, next_bases, settled_eigenvectors
from curvopt.optim.stages import NEWTON, GroupStep, Stage

DT = torch.float64
SEEDS = range(3)


def _psd(dim, generator):
    root = torch.randn(dim, dim + 1, dtype=DT, generator=generator)
    return root @ root.mT


def _mlp(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).to(DT)


def _trajectory(make, seed, steps=12):
    """The parameters after each of ``steps`` steps of batch 16 (``make(params)``), the
    Monte-Carlo draws and batches from ``seed``."""
    model = curvopt.extend(_mlp(seed))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    opt = make(model.parameters())
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    rows = []
    for _ in range(steps):
        X = torch.randn(16, 5, dtype=DT, generator=generator)
        y = torch.randint(0, 3, (16,), generator=generator)
        opt.zero_grad()
        lossfunc(model(X), y).backward()
        opt.step()
        rows.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return torch.stack(rows), model, opt


# ------------------------------------------------------------------------- one decomposition
def test_an_equal_factor_takes_the_basis_decomposed_before():
    """Equal factors (distinct tensors) from equal previous bases (or none) get the one basis,
    that of a decomposition of their own to the bit; another factor, or the same factor from
    another previous basis, is decomposed."""
    generator = torch.Generator().manual_seed(0)
    factor, other = _psd(4, generator), _psd(4, generator)
    previous = torch.linalg.qr(torch.randn(4, 4, dtype=DT, generator=generator))[0]
    refresh = Refresh()
    exact = refresh.basis(factor, None)
    assert refresh.basis(factor.clone(), None) is exact
    assert torch.equal(exact, settled_eigenvectors(factor))
    assert refresh.basis(other, None) is not exact
    warm = refresh.basis(factor, previous)
    assert warm is not exact
    assert refresh.basis(factor.clone(), previous.clone()) is warm
    norms, basis = warm_eigenbasis(factor, previous)
    order = norms.argsort(stable=True)
    assert torch.equal(warm, basis[:, order])  # (no null space here: nothing to settle)


def test_next_bases_share_one_refresh():
    """``next_bases`` of a weight ``[B, A]`` and its bias ``[B]`` in one ``Refresh``: the bias's
    basis is the weight's output-side one; without it, equal bits from a second decomposition."""
    generator = torch.Generator().manual_seed(1)
    B, A = _psd(3, generator), _psd(5, generator)
    refresh = Refresh()
    weight = next_bases([B, A], None, None, refresh)
    bias = next_bases([B.clone()], None, None, refresh)
    assert bias[0] is weight[0]
    assert torch.equal(next_bases([B.clone()], None)[0], weight[0])


@pytest.mark.parametrize("refresh", ["eigh", "warm"])
def test_a_layers_bias_takes_its_weights_output_basis(refresh):
    """In ``EKFAC``'s refreshes (exact or warm) a ``Linear``'s bias holds its weight's output
    basis itself, and the steps are those of bases decomposed one parameter at a time (a
    ``Refresh`` per parameter) bit for bit."""

    class Alone(Refresh):  # a refresh that never finds a factor decomposed before
        def basis(self, factor, previous, power=None):
            return Refresh().basis(factor, previous, power)

    make = lambda p: EKFAC(p, lr=0.1, curvature_interval=2, basis_refresh=refresh)  # noqa: E731
    shared, model, opt = _trajectory(make, 0)
    for layer in (model[0], model[2]):
        assert opt.state[layer.bias]["bases_next"][0] is opt.state[layer.weight]["bases_next"][0]
    original = ekfac_module.Refresh
    ekfac_module.Refresh = Alone
    try:
        alone, _, _ = _trajectory(make, 0)
    finally:
        ekfac_module.Refresh = original
    assert torch.equal(shared, alone)


def test_the_trust_region_shares_the_warm_refreshs_power_step(monkeypatch):
    """At a warm refresh the trust region's ``diag(Qᵀ F Q)`` reads the power step ``F Q`` of
    the refresh (``warm_eigh.power_step``) instead of forming ``F Q`` again: the eigenvalues
    are those of the separate product and of ``Qᵀ F Q``'s diagonal (float64), and the default
    steps (warm refreshes every 2 steps) are those of a twin that forms its own, bit for bit."""
    generator = torch.Generator().manual_seed(2)
    factor, basis = _psd(6, generator), settled_eigenvectors(_psd(6, generator))
    power = power_step(factor, basis)
    shared = basis_eigenvalues([basis], [factor], [power])[0]
    assert torch.equal(shared, basis_eigenvalues([basis], [factor])[0])
    torch.testing.assert_close(shared, (basis.T @ factor @ basis).diagonal())
    assert torch.equal(warm_eigenbasis(factor, basis, power)[1], warm_eigenbasis(factor, basis)[1])

    shared_powers = []
    original = ekfac_module._power_steps

    def recorded(factors, warm):
        powers = original(factors, warm)
        shared_powers.extend(q for q in powers or [] if q is not None)
        return powers

    make = lambda p: EKFAC(p, lr=0.1, curvature_interval=2)  # noqa: E731
    monkeypatch.setattr(ekfac_module, "_power_steps", recorded)
    steps, _, _ = _trajectory(make, 0)
    assert len(shared_powers) > 0  # the refreshes after the first shared them
    monkeypatch.setattr(ekfac_module, "_power_steps", lambda factors, warm: None)
    separate, _, _ = _trajectory(make, 0)
    assert torch.equal(steps, separate)


# ------------------------------------------------------------------------- the trust region
class _Identity(Stage):
    """A stage between the preconditioning (30) and the trust region (40) that changes nothing:
    the trust region then measures the direction it is handed, rotated into the basis."""

    order = 35

    def __call__(self, step: GroupStep) -> None:
        return None


def _quadratic_calls(monkeypatch) -> list:
    """One entry per call of ``ekfac.eigen_corrected_quadratic`` (a direction rotated into the
    basis for the trust region), recorded as it runs."""
    calls = []
    quadratic = ekfac_module.eigen_corrected_quadratic

    def counted(*args):
        calls.append(1)
        return quadratic(*args)

    monkeypatch.setattr(ekfac_module, "eigen_corrected_quadratic", counted)
    return calls


@pytest.mark.parametrize("seed", SEEDS)
def test_the_trust_region_measures_the_solves_coordinates(seed, monkeypatch):
    """At the defaults (``trust_metric="ggn"``) the trust region's ``Σ (K + λ) ⊙ (Q_Bᵀ D Q_A)²``
    is read off the solve's coordinates, no direction rotated again
    (``eigen_corrected_quadratic`` is not called), and the steps (the trust region cuts them:
    ``lr=1``) are those of the twin that rotates each direction, to 1e-12."""
    calls = _quadratic_calls(monkeypatch)
    coordinates, _, _ = _trajectory(lambda p: EKFAC(p, lr=1.0), seed)
    assert not calls
    chain = NEWTON.with_stage(_Identity())
    rotated, _, opt = _trajectory(lambda p: EKFAC(p, lr=1.0, stages=chain), seed)
    assert calls
    torch.testing.assert_close(coordinates, rotated, rtol=1e-12, atol=1e-14)
    start = torch.cat([p.detach().reshape(-1) for p in _mlp(seed).parameters()])
    steps = torch.diff(torch.cat([start[None], coordinates]), dim=0).norm(dim=1)
    unclipped, _, _ = _trajectory(lambda p: EKFAC(p, lr=1.0, kl_clip=None), seed)
    free = torch.diff(torch.cat([start[None], unclipped]), dim=0).norm(dim=1)
    assert steps[0] < 0.5 * free[0]  # the trust region cut the first step: ν was in use


# ------------------------------------------------------------------------- warm by default
def test_basis_refresh_default_is_warm_under_the_default_damping_only():
    """Warm under ``λ = α s`` alone: not with a damping, a relative damping, the paper's
    ``basis_source="current"``, nor where named."""
    params = list(_mlp(0).parameters())
    assert basis_refresh(EKFAC(params, lr=0.1).param_groups[0]) == "warm"
    assert basis_refresh(EKFAC(params, lr=0.1, damping=1e-3).param_groups[0]) == "eigh"
    relative = EKFAC(params, lr=0.1, relative_damping=0.03).param_groups[0]
    assert basis_refresh(relative) == "eigh"
    current = EKFAC(params, lr=0.1, basis_source="current").param_groups[0]
    assert basis_refresh(current) == "eigh"
    named = EKFAC(params, lr=0.1, basis_refresh="eigh").param_groups[0]
    assert basis_refresh(named) == "eigh"


def test_basis_interval_default_is_three_curvature_intervals_under_the_default_damping_only():
    params = list(_mlp(0).parameters())
    group = lambda **options: EKFAC(params, lr=0.1, **options).param_groups[0]  # noqa: E731
    assert basis_interval(group()) == 30
    assert basis_interval(group(curvature_interval=2)) == 6
    assert basis_interval(group(damping=1e-3)) == 1  # the paper's: a basis at every step
    assert basis_interval(group(relative_damping=0.03)) == 10
    assert basis_interval(group(basis_source="current")) == 10
    assert basis_interval(group(curvature_interval=2, basis_interval=4)) == 4


@pytest.mark.parametrize("options, named", [({}, 6), ({"damping": 1e-2}, 2)])
def test_the_default_basis_interval_steps_as_the_interval_it_names(options, named):
    """Over 24 steps with ``curvature_interval=2``, ``EKFAC(lr)`` steps as ``basis_interval=6``
    and, with a damping given, as ``basis_interval=2``, bit for bit; the default is not a basis
    at every curvature step (``S`` is still recomputed at each, in the last basis)."""
    make = lambda interval: (  # noqa: E731
        lambda p: EKFAC(p, lr=0.1, curvature_interval=2, basis_interval=interval, **options)
    )
    default, _, _ = _trajectory(make(None), 0, steps=24)
    assert torch.equal(default, _trajectory(make(named), 0, steps=24)[0])
    if named == 6:
        assert not torch.equal(default, _trajectory(make(2), 0, steps=24)[0])


@pytest.mark.parametrize(
    "options, named",
    [({}, "warm"), ({"damping": 1e-2}, "eigh")],
)
def test_the_default_refresh_steps_as_the_refresh_it_names(options, named):
    """Over 12 steps (basis refreshes at steps 0 and 6 under the default damping, at every
    second step with a damping given), ``EKFAC(lr)`` steps as ``basis_refresh="warm"`` and,
    with a damping given, as ``"eigh"``, bit for bit; the warm default is not the exact one."""
    make = lambda refresh: (
        lambda p: EKFAC(  # noqa: E731
            p, lr=0.1, curvature_interval=2, basis_refresh=refresh, **options
        )
    )
    default, _, _ = _trajectory(make(None), 0)
    assert torch.equal(default, _trajectory(make(named), 0)[0])
    if named == "warm":
        assert not torch.equal(default, _trajectory(make("eigh"), 0)[0])


@pytest.mark.parametrize(
    "options", [{"damping": 1e-2, "trust_metric": "ggn"}, {"relative_damping": 0.03}]
)
def test_other_dampings_keep_rotating_the_direction(options, monkeypatch):
    """With a damping or a relative damping given the trust region (``"ggn"``) rotates each
    direction into the basis as before: those settings keep their steps to the bit."""
    calls = _quadratic_calls(monkeypatch)
    _trajectory(lambda p: EKFAC(p, lr=1.0, **options), 0, steps=3)
    assert len(calls) == 3 * 4  # every parameter at every step
