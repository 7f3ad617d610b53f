"""Plain steps: a step that refreshes no curvature (``curvature_interval``) leaves the engine alone.

While the optimizer's armed collection rests (its next step collects nothing) and no block is
open, the forward hooks return at once: no record, no gradient hook, no backward pass of the
engine (spies count the records the hooks make, the loss records and the engine's passes). The
step itself applies the cached curvature: checked in float64 against the damped inverse formed
by hand from the factors the last refresh wrote. Windows of several micro-batches and closure
steps rest or collect as a whole; a loaded state rests where its step counter says so.
"""

import gc
import math

import pytest
import torch
from conftest import free_earlier_optimizers
from torch import nn

import curvopt
from curvopt.core.state import STATE
from curvopt.frontend import collection, hooks
from curvopt.optim import EKFAC, KFAC, DiagGGNNewton

OPTIMIZERS = {"KFAC": KFAC, "EKFAC": EKFAC, "DiagGGNNewton": DiagGGNNewton}


@pytest.fixture(autouse=True)
def _no_other_optimizer():
    """Optimizers of earlier tests, in reference cycles, are freed: an awake one would collect."""
    free_earlier_optimizers()


def _refreshes(name: str, step: int, interval: int) -> bool:
    """Whether ``step`` collects with curvature every ``interval`` steps: ``EKFAC`` (its
    default ``basis_source="last_refresh"``) also at step 1, where its first basis is put to
    use (``S`` recomputed in it)."""
    return step % interval == 0 or (name == "EKFAC" and step == 1)


def _every(name: str, interval: int) -> dict:
    """Curvature every ``interval`` steps (EKFAC: its basis too, a multiple of it)."""
    options = {"curvature_interval": interval}
    return {**options, "basis_interval": interval} if name == "EKFAC" else options


class Spy:
    """Counts what the engine does: records of module calls and losses, backward passes."""

    def __init__(self, monkeypatch):
        self.records = self.losses = self.passes = 0
        record, hook_loss, backward_pass = hooks.Record, hooks.hook_loss, collection.BackwardPass

        def counted_record(*args, **kwargs):
            self.records += 1
            return record(*args, **kwargs)

        def counted_loss(*args, **kwargs):
            self.losses += 1
            return hook_loss(*args, **kwargs)

        def counted_pass(*args, **kwargs):
            self.passes += 1
            return backward_pass(*args, **kwargs)

        monkeypatch.setattr(hooks, "Record", counted_record)
        monkeypatch.setattr(hooks, "hook_loss", counted_loss)
        monkeypatch.setattr(collection, "BackwardPass", counted_pass)

    def take(self) -> tuple[int, int, int]:
        counts = (self.records, self.losses, self.passes)
        self.records = self.losses = self.passes = 0
        return counts


def _problem(seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).to(dtype)
    return curvopt.extend(model), curvopt.extend(nn.CrossEntropyLoss())


def _batch(step, n=12, dtype=torch.float64):
    generator = torch.Generator().manual_seed(100 + step)
    X = torch.randn(n, 5, dtype=dtype, generator=generator)
    return X, torch.randint(0, 3, (n,), generator=generator)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_hooks_do_no_work_between_refreshes(name, monkeypatch):
    model, lossfunc = _problem()
    opt = OPTIMIZERS[name](model.parameters(), lr=0.1, damping=0.1, **_every(name, 3))
    spy = Spy(monkeypatch)
    counts = []
    for step in range(7):
        opt.zero_grad()
        assert STATE.plain == (not _refreshes(name, step, 3))
        X, y = _batch(step)
        lossfunc(model(X), y).backward()
        opt.step()
        counts.append(spy.take())
    for step, (records, losses, passes) in enumerate(counts):
        if _refreshes(name, step, 3):
            assert records == 2 and losses == 1 and passes == 1, (step, counts)
        else:
            assert (records, losses, passes) == (0, 0, 0), (step, counts)
    assert STATE.plain  # step 7 is a plain one again
    del opt
    gc.collect()
    assert not STATE.plain and STATE.collecting is None  # nothing armed: the hooks record


def _trace_norm_step(grad, factors, damping):
    """``(B + √λ/π I)⁻¹ G (A + π√λ I)⁻¹`` with ``π = sqrt((tr A/dim A)/(tr B/dim B))``, or
    ``(B + λ I)⁻¹ g`` for a bias."""
    if len(factors) == 1:
        (B,) = factors
        return torch.linalg.solve(B + damping * torch.eye(len(B), dtype=B.dtype), grad)
    B, A = factors
    pi = math.sqrt((A.trace() / len(A)) / (B.trace() / len(B)))
    root = math.sqrt(damping)
    left = torch.linalg.inv(B + root / pi * torch.eye(len(B), dtype=B.dtype))
    right = torch.linalg.inv(A + pi * root * torch.eye(len(A), dtype=A.dtype))
    return left @ grad @ right


@pytest.mark.parametrize("name", ["KFAC", "DiagGGNNewton"])
def test_a_plain_step_applies_the_curvature_of_the_last_refresh(name):
    """Steps 1 and 2 of ``curvature_interval=3`` precondition their own gradients with the
    damped curvature step 0 wrote (formed here by hand), which no pass replaces."""
    model, lossfunc = _problem()
    lr, damping = 0.2, 0.05
    curvature = "kflr" if name == "KFAC" else "exact"
    opt = OPTIMIZERS[name](
        model.parameters(), lr, damping, curvature, curvature_interval=3, kl_clip=None
    )
    attr = "kflr" if name == "KFAC" else "diag_ggn_exact"
    for step in range(3):
        opt.zero_grad()
        X, y = _batch(step)
        lossfunc(model(X), y).backward()
        if step == 0:
            written = {id(p): getattr(p, attr) for p in model.parameters()}
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        if step == 0:
            continue
        for p, old in zip(model.parameters(), before):
            assert getattr(p, attr) is written[id(p)]  # nothing collected since step 0
            C = written[id(p)]
            if name == "KFAC":
                expected = _trace_norm_step(p.grad, [f.detach() for f in C], damping)
            else:
                expected = p.grad / (C + damping)
            torch.testing.assert_close(old - p.detach(), lr * expected, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_micro_batch_windows_rest_or_collect_as_a_whole(name, monkeypatch):
    """Three micro-batches between two steps: every pass of a refreshing window collects and
    the attribute combines them (a new one each refresh); a plain window's passes make none."""
    model, lossfunc = _problem()
    opt = OPTIMIZERS[name](model.parameters(), lr=0.1, damping=0.1, **_every(name, 2))
    attr = {"KFAC": "kfac", "EKFAC": "ekfac", "DiagGGNNewton": "diag_ggn_mc"}[name]
    spy = Spy(monkeypatch)
    seen = []
    for window in range(4):
        opt.zero_grad()
        for micro in range(3):
            X, y = _batch(10 * window + micro, n=4)
            lossfunc(model(X), y).backward()
        seen.append(getattr(model[0].weight, attr))
        records, losses, passes = spy.take()
        if _refreshes(name, window, 2):
            assert (records, losses, passes) == (6, 3, 3), window
        else:
            assert (records, losses, passes) == (0, 0, 0), window
            assert seen[-1] is seen[-2]  # the refresh's values stay in use
        opt.step()
    assert seen[2] is not seen[0]


def test_closure_steps_rest_between_refreshes(monkeypatch):
    model, lossfunc = _problem()
    opt = KFAC(model.parameters(), lr=0.1, damping=0.1, curvature_interval=2)
    spy = Spy(monkeypatch)
    for step in range(4):
        X, y = _batch(step)

        def closure(X=X, y=y):
            opt.zero_grad()
            loss = lossfunc(model(X), y)
            loss.backward()
            return loss

        opt.step(closure)
        assert spy.take() == ((2, 1, 1) if step % 2 == 0 else (0, 0, 0)), step


def test_a_loaded_state_rests_where_its_step_counter_says(monkeypatch):
    model, lossfunc = _problem()
    opt = KFAC(model.parameters(), lr=0.1, damping=0.1, curvature_interval=2)
    opt.zero_grad()
    X, y = _batch(0)
    lossfunc(model(X), y).backward()
    opt.step()
    saved = opt.state_dict()  # at step 1: a plain one next
    fresh = KFAC(model.parameters(), lr=0.1, damping=0.1, curvature_interval=2)
    del opt
    gc.collect()
    assert not STATE.plain  # its first step refreshes
    fresh.load_state_dict(saved)
    assert STATE.plain
    spy = Spy(monkeypatch)
    fresh.zero_grad()
    lossfunc(model(X), y).backward()
    fresh.step()
    assert spy.take() == (0, 0, 0)
    assert not STATE.plain  # step 2 refreshes


def test_a_collect_block_opened_on_a_plain_step_collects():
    """The hooks rest only while no block is open: a block around forward and backward on a
    plain step computes its quantities as ever."""
    model, lossfunc = _problem()
    opt = KFAC(model.parameters(), lr=0.1, damping=0.1, curvature_interval=3)
    X, y = _batch(0)
    for _ in range(2):
        opt.zero_grad()
        lossfunc(model(X), y).backward()
        opt.step()
    assert STATE.plain
    with curvopt.collect(curvopt.extensions.BatchGrad()):
        assert not STATE.plain
        loss = torch.nn.functional.cross_entropy(model(X), y, reduction="sum")
        model.zero_grad()
        loss.backward()
    assert STATE.plain
    batch = model[0].weight.grad_batch
    assert batch.shape == (len(X), *model[0].weight.shape)
    torch.testing.assert_close(batch.sum(0), model[0].weight.grad)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_defaults_rest_nine_steps_in_ten_and_a_damping_given_none(name, monkeypatch):
    """``cls(params, lr=...)``: the curvature at steps 0 and 10 (``EKFAC``: and 1), plain steps
    between; with a damping given (the paper's setting) every step collects."""
    spy = Spy(monkeypatch)
    refreshes = {step for step in range(12) if _refreshes(name, step, 10)}
    for damping, collecting in ((None, refreshes), (1e-3, set(range(12)))):
        free_earlier_optimizers()
        model, lossfunc = _problem()
        opt = OPTIMIZERS[name](model.parameters(), lr=0.1, damping=damping)
        seen = set()
        for step in range(12):
            opt.zero_grad()
            X, y = _batch(step)
            lossfunc(model(X), y).backward()
            opt.step()
            if spy.take() != (0, 0, 0):
                seen.add(step)
        assert seen == collecting, (damping, seen)


def test_an_explicit_optimizer_keeps_the_records_its_block_needs():
    """A resting armed optimizer on one model, an explicit one on another (forward outside its
    block, backward inside, as documented): the hooks record while the explicit one's next
    step collects, and its steps equal those of a twin made where nothing else is alive."""
    free_earlier_optimizers()
    model, lossfunc = _problem()
    resting = KFAC(model.parameters(), lr=0.1, damping=0.1, curvature_interval=5)
    for step in range(2):
        resting.zero_grad()
        X, y = _batch(step)
        lossfunc(model(X), y).backward()
        resting.step()
    assert STATE.plain
    runs = []
    for alive in (True, False):
        if not alive:
            del resting
            gc.collect()
        other, _ = _problem(seed=1)
        opt = KFAC(other.parameters(), lr=0.1, damping=0.1, curvature_interval=2,
                   collection="explicit")  # fmt: skip
        for step in range(4):
            opt.zero_grad()
            X, y = _batch(step)
            loss = lossfunc(other(X), y)  # before the block
            assert STATE.plain == (alive and step % 2 == 1)
            with opt.collect():
                loss.backward()
            opt.step()
        runs.append([p.detach().clone() for p in other.parameters()])
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
