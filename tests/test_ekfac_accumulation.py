"""EKFAC under gradient accumulation: the default ``basis_source="last_refresh"`` gives one
batch's step.

Every micro-batch of a window must rotate into the same basis for ``S`` to add. With
``"last_refresh"`` (the default) the window's factors (which add over micro-batches exactly) give
the basis of the next steps, and the first step is in the identity basis: micro-batches give one
batch's step, at the defaults (relative damping, curvature every 10 steps, the trust region) and
with an explicit damping, on refresh steps and between them. With the paper's
``basis_source="current"`` a basis step's basis comes from its first micro-batch's factors (a
pass must know its basis before it computes ``S``), so two micro-batches take another step than
one batch; it warns. Compared in float64 on the tiny GPT (tied head, LayerNorms, attention) and
an MLP, both reductions, ``kflr`` and ``kfac`` (the same Monte-Carlo draws: the micro-batches
draw in the batch's order), against one batch; and the step itself against a dense reference
(per-sample gradients of a loop, ``torch.linalg.eigh``).
"""
from __future__ import annotations

import copy
import warnings
from types import SimpleNamespace

import pytest
import torch
from test_optim_models_fallback import _batch, _net
from test_optim_variants import per_sample_grads
from torch import nn

import curvopt
from curvopt import extensions as ext
from curvopt.optim import EKFAC
from curvopt.optim.one_sided import next_bases, settled_eigenvectors
from fixtures import zoo

DT = torch.float64
N = 32
STEPS = 3


def _wide_mlp(reduction: str) -> SimpleNamespace:
    """``Linear(24, 80) - Tanh - Linear(80, 3)``: factors wider than twice the batch of
    :data:`N`, so that most of a factor is null space (the second layer's input factor, and
    under ``curvature="kfac"`` the first layer's output factor), which
    ``one_sided.settled_eigenvectors`` settles as the complement of the other eigenvectors
    (without it the steps of 2 micro-batches are 1e-2 from one batch's)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 80), nn.Tanh(), nn.Linear(80, 3)).to(DT)

    def make_batch(n: int, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        inputs = torch.randn(n, 24, generator=gen, dtype=DT)
        return inputs, torch.randint(0, 3, (n,), generator=gen)

    lossfunc = nn.CrossEntropyLoss(reduction=reduction)
    loss_on = lambda out, y, other=None: (other or lossfunc)(out, y)  # noqa: E731
    return SimpleNamespace(model=model, lossfunc=lossfunc, make_batch=make_batch, loss_on=loss_on)


PROBLEMS = {"gpt": zoo.gpt, "mlp": zoo.mlp, "wide": _wide_mlp}


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _train(
    problem: str, reduction: str, micro_batches: int, steps: int = STEPS, **options
):
    """The parameters before and after ``steps`` steps of ``EKFAC(lr=0.1, **options)``
    (``damping=0.1`` unless given) on batches of ``N``, each split into ``micro_batches``
    backward passes of (nearly) equal sizes whose losses sum to the batch's (``"mean"``: each
    weighted by its share of the batch; every target counted), and the warnings raised."""
    made = PROBLEMS[problem](reduction)
    model, lossfunc = curvopt.extend(made.model), curvopt.extend(made.lossfunc)
    opt = EKFAC(model.parameters(), lr=0.1, **{"damping": 0.1, **options})
    start = _flat(model)
    torch.manual_seed(5)  # the Monte-Carlo draws of curvature="kfac"
    bounds = torch.linspace(0, N, micro_batches + 1).long().tolist()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            X, y = made.make_batch(N, step)
            y = y.clamp(min=0)  # every target counted: the micro-batch means average to one
            opt.zero_grad()
            for a, b in zip(bounds, bounds[1:]):
                loss = made.loss_on(model(X[a:b]), y[a:b], lossfunc)
                (loss * (b - a) / N if reduction == "mean" else loss).backward()
            opt.step()
    basis_warnings = [w for w in caught if "backward passes of this step" in str(w.message)]
    return start, _flat(model), basis_warnings


@pytest.mark.parametrize("curvature", ["kflr", "kfac"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("problem", list(PROBLEMS))
def test_two_micro_batches_give_one_batchs_step(problem, reduction, curvature):
    options = {"curvature": curvature, "basis_source": "last_refresh"}
    start, one, _ = _train(problem, reduction, 1, **options)
    _, two, warned = _train(problem, reduction, 2, **options)
    moved = (one - start).norm()
    assert moved > 1e-3  # the steps say something
    assert (two - one).norm() <= 1e-12 * moved, float((two - one).norm() / moved)
    assert not warned


DEFAULTS = {
    "explicit damping": {},
    # relative damping, curvature every 10 steps: step 0 a refresh, steps 1-3 plain ones
    "defaults": {"damping": None},
    "defaults, curvature every 2 steps": {"damping": None, "curvature_interval": 2},
}


@pytest.fixture(scope="module")
def one_batch_over_4_steps():
    """``(start, end)`` of :func:`_train` on whole batches over 4 steps, by ``(problem,
    reduction, curvature, settings)``: computed once, the reference of both micro-batch counts
    (the run is deterministic, its tensors are not modified)."""
    runs: dict = {}

    def run(problem, reduction, curvature, settings):
        key = (problem, reduction, curvature, settings)
        if key not in runs:
            options = {"curvature": curvature, **DEFAULTS[settings]}
            runs[key] = _train(problem, reduction, 1, steps=4, **options)[:2]
        return runs[key]

    return run


@pytest.mark.parametrize("settings", list(DEFAULTS))
@pytest.mark.parametrize("micro_batches", [2, 3])
@pytest.mark.parametrize("curvature", ["kflr", "kfac"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("problem", list(PROBLEMS))
def test_default_ekfac_micro_batches_give_one_batchs_step(
    problem, reduction, curvature, micro_batches, settings, one_batch_over_4_steps
):
    """No ``basis_source``: 2 and 3 micro-batches (3: of unequal sizes) take the steps of one
    batch over 4 steps (refresh steps, and with ``curvature_interval`` the plain steps between
    them), without a warning."""
    options = {"curvature": curvature, **DEFAULTS[settings]}
    start, one = one_batch_over_4_steps(problem, reduction, curvature, settings)
    _, split, warned = _train(problem, reduction, micro_batches, steps=4, **options)
    moved = (one - start).norm()
    assert moved > 1e-3  # the steps say something
    assert (split - one).norm() <= 1e-12 * moved, float((split - one).norm() / moved)
    assert not warned


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_micro_batches_give_one_batchs_step_between_refreshes(reduction):
    """``basis_interval=2``: the basis of step 2 is the refresh of step 0's window."""
    options = {"curvature": "kflr", "basis_source": "last_refresh", "basis_interval": 2}
    start, one, _ = _train("gpt", reduction, 1, **options)
    _, four, _ = _train("gpt", reduction, 4, **options)
    assert (four - one).norm() <= 1e-12 * (one - start).norm()


@pytest.mark.parametrize("problem", list(PROBLEMS))
def test_the_current_basis_is_its_first_micro_batchs_and_warns_once(problem):
    """The check above can fail: with ``basis_source="current"`` (the paper's) the basis of
    each step is its first micro-batch's, another step than one batch's; it warns once, and a
    single pass per step does not."""
    options = {"curvature": "kflr", "basis_source": "current"}
    start, one, warned_one = _train(problem, "sum", 1, **options)
    _, two, warned_two = _train(problem, "sum", 2, **options)
    assert (two - one).norm() > 1e-3 * (one - start).norm()
    assert not warned_one
    assert len(warned_two) == 1
    assert "basis_source='last_refresh'" in str(warned_two[0].message)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_last_refresh_step_equals_dense_reference(reduction):
    """Step ``t`` rotates into the eigenbasis of the ``kflr`` factors of step ``t − 1``'s batch
    (at its parameters), the first step into the identity: ``S = c Σ_n (Q_Bᵀ G_n Q_A)²`` from
    per-sample gradients of a loop, the step ``(Q diag(vec S) Qᵀ + λ I)⁻¹ g`` by a dense
    solve."""
    torch.manual_seed(0)
    model = curvopt.extend(nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DT))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss(reduction=reduction))
    damping = 0.05
    opt = EKFAC(
        model.parameters(), 1.0, damping, "kflr", basis_source="last_refresh", kl_clip=None
    )
    weight = model[0].weight
    gen = torch.Generator().manual_seed(3)
    c = 8 if reduction == "mean" else 1
    bases = [torch.eye(5, dtype=DT), torch.eye(4, dtype=DT)]
    for _ in range(3):
        x = 3 * torch.randn(8, 4, generator=gen, dtype=DT)
        y = torch.randint(0, 3, (8,), generator=gen)
        grads = per_sample_grads(model, lossfunc, x, y, 0)  # [8, 5, 4]
        twin = curvopt.extend(copy.deepcopy(model))
        with curvopt.collect(ext.KFLR()):
            lossfunc(twin(x), y).backward()
        before = weight.detach().clone()
        opt.zero_grad()
        lossfunc(model(x), y).backward()
        opt.step()
        q_b, q_a = bases
        rotation = torch.kron(q_b, q_a)
        moments = c * ((q_b.T @ grads @ q_a).reshape(8, -1) ** 2).sum(0)
        curvature = rotation @ torch.diag(moments) @ rotation.T
        expected = torch.linalg.solve(
            curvature + damping * torch.eye(20, dtype=DT), grads.sum(0).flatten()
        )
        torch.testing.assert_close((before - weight.detach()).flatten(), expected)
        bases = [torch.linalg.eigh(f)[1] for f in twin[0].weight.kflr]  # the next steps'


def test_settled_eigenvectors_of_a_null_space_do_not_depend_on_rounding():
    """A factor ``XᵀX`` of rows in a 3-dimensional subspace of ``R⁶`` (a null space of 3), once
    of the whole batch and once summed over two halves (equal to rounding): ``eigh``'s null
    vectors turn against each other, the settled ones agree (up to sign), and both are
    eigenvectors."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(16, 3, generator=gen, dtype=DT) @ torch.randn(3, 6, generator=gen, dtype=DT)
    whole, halves = rows.T @ rows, rows[:8].T @ rows[:8] + rows[8:].T @ rows[8:]
    raw = [torch.linalg.eigh(f)[1][:, :3] for f in (whole, halves)]
    settled = [settled_eigenvectors(f) for f in (whole, halves)]
    assert (raw[0].T @ raw[1]).abs().max() < 1 - 1e-6  # eigh's own: turned
    alignment = (settled[0].T @ settled[1]).abs()
    torch.testing.assert_close(alignment, torch.eye(6, dtype=DT), atol=1e-10, rtol=0)
    for f, q in zip((whole, halves), settled):
        torch.testing.assert_close(q.T @ q, torch.eye(6, dtype=DT))
        rotated = q.T @ f @ q
        torch.testing.assert_close(rotated, torch.diag(rotated.diagonal()), atol=1e-12, rtol=0)


@pytest.mark.parametrize("rank", [3, 2], ids=["null block", "complement of the range"])
def test_settled_null_space_is_the_factors_alone(rank):
    """Both constructions of :func:`settled_eigenvectors` (nullity ``6 - rank``: 3 ≤ 3 turns
    ``eigh``'s null block, 4 > 2 takes the complement of the other eigenvectors): the factor
    of the whole batch and the one summed over halves (equal to rounding) get the same basis
    up to signs, eigenvectors of the factor; so do the bases of a warm refresh (``next_bases``)
    from the basis of another batch's factor of the same rows' space; the null columns span the
    null space of ``eigh``'s own (the projections agree)."""
    gen = torch.Generator().manual_seed(1)
    mixing = torch.randn(rank, 6, generator=gen, dtype=DT)
    rows, earlier = (torch.randn(16, rank, generator=gen, dtype=DT) @ mixing for _ in range(2))
    whole, halves = rows.T @ rows, rows[:8].T @ rows[:8] + rows[8:].T @ rows[8:]
    previous = settled_eigenvectors(earlier.T @ earlier)
    nullity = 6 - rank
    for settle in (settled_eigenvectors, lambda f: next_bases([f], None, [previous])[0]):
        settled = [settle(f) for f in (whole, halves)]
        alignment = (settled[0].T @ settled[1]).abs()
        torch.testing.assert_close(alignment, torch.eye(6, dtype=DT), atol=1e-10, rtol=0)
        for f, q in zip((whole, halves), settled):
            torch.testing.assert_close(q.T @ q, torch.eye(6, dtype=DT))
            null = torch.linalg.eigh(f)[1][:, :nullity]
            torch.testing.assert_close(f @ q[:, :nullity], null * 0, atol=1e-12, rtol=0)
            projection = q[:, :nullity] @ q[:, :nullity].T
            torch.testing.assert_close(projection, null @ null.T, atol=1e-10, rtol=0)


def test_basis_source_is_validated():
    with pytest.raises(ValueError, match="basis_source must be one of"):
        EKFAC(nn.Linear(2, 2).parameters(), 0.1, 0.1, basis_source="next")


@pytest.mark.parametrize("curvature", ["kflr", "kfac"])
def test_micro_batches_give_one_batchs_step_with_a_fallback_parameter(curvature):
    """A raw weight used non-linearly (``test_optim_models_fallback.Net``'s ``mix.w``, no
    Kronecker factors) takes its default ``fallback="diagonal"`` step from the diagonal of the
    factors collected beside: 3 micro-batches of 2 take one batch's steps (4 steps, the
    defaults; ``curvature_interval=2``: refresh and plain steps)."""

    def run(micro_batches):
        model = _net()
        opt = EKFAC(model.parameters(), lr=0.1, curvature=curvature, curvature_interval=2)
        lossfunc = curvopt.extend(nn.CrossEntropyLoss())
        start = _flat(model)
        torch.manual_seed(5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the fallback's announcement
            for step in range(4):
                X, y = _batch(step + 1)
                opt.zero_grad()
                for part in torch.arange(len(X)).chunk(micro_batches):
                    (lossfunc(model(X[part]), y[part]) * len(part) / len(X)).backward()
                opt.step()
        assert "fallback_diagonal" in opt.state[model.mix.w]
        return start, _flat(model)

    start, one = run(1)
    _, three = run(3)
    moved = (one - start).norm()
    assert moved > 1e-3
    assert (three - one).norm() <= 1e-12 * moved, float((three - one).norm() / moved)
