"""Drop-in optimizers: the collection armed by the optimizer, and micro-batches that combine.

Every comparison is in float64 against the explicit loop (``collection="explicit"``, the
backward pass inside ``opt.collect()``) on one batch: an armed optimizer with the backward
passes outside any block, split into 2 or 4 micro-batches (also of unequal sizes), must take
the same steps (≤ 1e-12 relative) wherever the objectives coincide.
"""

import copy
import gc

import pytest
import torch
from torch import nn

import curvopt
from curvopt import extensions as ext
from curvopt.errors import AccumulationError, ExtensionConflictError
from curvopt.optim import EKFAC, KFAC, DiagGGNNewton, VarianceAdaptedSGD
from curvopt.core.psd import psd_eigh
from curvopt.core.state import STATE

DT = torch.float64
N = 12

#: deterministic curvatures, so that one batch and its micro-batches see the same numbers
OPTIMIZERS = {
    "kflr": lambda p, **kw: KFAC(p, lr=0.2, damping=0.1, curvature="kflr", **kw),
    "diag_ggn": lambda p, **kw: DiagGGNNewton(p, lr=0.2, damping=0.1, curvature="exact", **kw),
    "variance": lambda p, **kw: VarianceAdaptedSGD(p, lr=0.2, **kw),
    "ekfac": lambda p, **kw: EKFAC(p, 0.2, 0.1, "kflr", basis_interval=2, **kw),
}


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DT)


def _cnn():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Unflatten(1, (1, 2, 2)),
        nn.Conv2d(1, 3, 2, padding=1),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(27, 3),
    ).to(DT)


MODELS = {"mlp": _mlp, "cnn": _cnn}


def _data(seed):
    g = torch.Generator().manual_seed(seed)
    return 3 * torch.randn(N, 4, generator=g, dtype=DT), torch.randint(0, 3, (N,), generator=g)


def _params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _closure(opt, model, lossfunc, X, y):
    """The closure ``opt.step`` takes: zero the gradients, backpropagate the loss, return it."""

    def closure():
        opt.zero_grad()
        loss = lossfunc(model(X), y)
        loss.backward()
        return loss

    return closure


def _assert_same(a, b):
    scale = b.abs().max()
    assert (a - b).abs().max() <= 1e-12 * scale, float((a - b).abs().max() / scale)


def _explicit_run(make_model, make_opt, steps, reduction="mean"):
    """The reference: one batch per step, the backward inside ``opt.collect()``."""
    model = curvopt.extend(make_model())
    lossfunc = curvopt.extend(nn.CrossEntropyLoss(reduction=reduction))
    opt = make_opt(model.parameters(), collection="explicit")
    for step in range(steps):
        X, y = _data(step)
        opt.zero_grad()
        with opt.collect():
            lossfunc(model(X), y).backward()
        opt.step()
    return _params(model)


def _split(sizes):
    bounds = [0]
    for s in sizes:
        bounds.append(bounds[-1] + s)
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


#: micro-batch sizes and how each micro-batch's loss is weighted, so that the passes sum to
#: the mean over the whole batch: as frameworks do (mean / k), with a sum divided by the
#: batch's count (Hugging Face's ``num_items_in_batch``)
SPLITS = {
    "2_equal_mean_over_k": ([6, 6], "mean"),
    "4_equal_mean_over_k": ([3, 3, 3, 3], "mean"),
    "2_unequal_sum_over_count": ([5, 7], "sum"),
    "4_unequal_sum_over_count": ([2, 5, 1, 4], "sum"),
}


def _micro_run(make_model, make_opt, steps, sizes, reduction):
    model = curvopt.extend(make_model())
    lossfunc = curvopt.extend(nn.CrossEntropyLoss(reduction=reduction))
    opt = make_opt(model.parameters())
    for step in range(steps):
        X, y = _data(step)
        opt.zero_grad()
        parts = _split(sizes)
        for part in parts:
            loss = lossfunc(model(X[part]), y[part])
            weight = 1 / len(parts) if reduction == "mean" else 1 / N
            (loss * weight).backward()
        opt.step()
    return _params(model)


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_armed_optimizer_takes_the_explicit_steps(name, model):
    """No ``with`` block: the same steps as the backward inside ``opt.collect()``."""
    want = _explicit_run(MODELS[model], OPTIMIZERS[name], steps=3)
    got = _micro_run(MODELS[model], OPTIMIZERS[name], 3, [N], "mean")
    _assert_same(got, want)


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_micro_batches_take_the_step_of_one_batch(name, model, split):
    """2 and 4 micro-batches (also unequal) between two steps: the steps of the whole batch.
    EKFAC at its default ``basis_source="last_refresh"`` too: its first step in the identity
    basis, its second in the basis of the first window's summed factors."""
    sizes, reduction = SPLITS[split]
    want = _explicit_run(MODELS[model], OPTIMIZERS[name], steps=2)
    got = _micro_run(MODELS[model], OPTIMIZERS[name], 2, sizes, reduction)
    _assert_same(got, want)


def test_only_the_last_micro_batch_would_differ():
    """The comparison above can fail: one micro-batch's curvature gives another step."""
    want = _explicit_run(_mlp, OPTIMIZERS["kflr"], steps=1)
    model = curvopt.extend(_mlp())
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    opt = OPTIMIZERS["kflr"](model.parameters())
    X, y = _data(0)
    opt.zero_grad()
    (lossfunc(model(X[:6]), y[:6]) / 2).backward()
    with curvopt.collect(ext.KFLR()):  # the last micro-batch's factors only
        (lossfunc(model(X[6:]), y[6:]) / 2).backward()
    with pytest.raises(AccumulationError, match="inside a curvopt.collect block"):
        opt.step()
    assert not torch.allclose(_params(model), want)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_ekfac_refresh_step_accumulates_in_the_basis_of_its_first_micro_batch(reduction):
    """The paper's ``basis_source="current"``: on a basis step the first micro-batch's factors
    give the basis; ``S`` is that of the whole batch in it (fresh bases of two passes could
    not add)."""
    model = curvopt.extend(_mlp())
    lossfunc = curvopt.extend(nn.CrossEntropyLoss(reduction=reduction))
    opt = EKFAC(model.parameters(), 0.2, 0.1, "kflr", basis_source="current")  # the paper's
    X, y = _data(0)
    sizes, weight = ([6, 6], 0.5) if reduction == "mean" else ([5, 7], 1.0)
    for part in _split(sizes):
        (lossfunc(model(X[part]), y[part]) * weight).backward()
    got = [[t.clone() for t in p.ekfac] for p in model.parameters()]
    reference = curvopt.extend(_mlp())
    with curvopt.collect(ext.KFLR()):
        (lossfunc(reference(X[: sizes[0]]), y[: sizes[0]]) * weight).backward()
    bases = {p: [psd_eigh(f)[1] for f in p.kflr] for p in reference.parameters()}
    with curvopt.collect(ext.EKFAC(factors="kflr", bases=bases)):
        lossfunc(reference(X), y).backward()
    for (s, *qs), p in zip(got, reference.parameters()):
        for q, want in zip(qs, bases[p]):
            _assert_same(q, want)
        _assert_same(s, p.ekfac[0])
    opt.step()


def test_ekfac_s_is_linear_in_the_loss_weight_as_the_ggn():
    """``S`` of ``w · loss`` is ``w`` times ``S`` of the loss (``KFLR``'s ``B`` too)."""
    model = curvopt.extend(_mlp())
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    X, y = _data(0)
    bases = {p: [] for p in model.parameters()}
    values = []
    for weight in (1.0, 0.25):
        with curvopt.collect(ext.EKFAC(factors="kflr", bases=bases), ext.KFLR()):
            (weight * lossfunc(model(X), y)).backward()
        values.append([(p.ekfac[0].clone(), p.kflr[0].clone()) for p in model.parameters()])
        model.zero_grad()
    for (s1, b1), (s2, b2) in zip(*values):
        _assert_same(s2, 0.25 * s1)
        _assert_same(b2, 0.25 * b1)


def test_two_optimizers_on_disjoint_parameters_each_collect_their_own():
    """KFAC on the first layer, the diagonal Newton step on the last: each armed, scoped to
    its parameters, each step that of its explicit twin."""

    def run(explicit):
        model = curvopt.extend(_mlp())
        lossfunc = curvopt.extend(nn.CrossEntropyLoss())
        kw = {"collection": "explicit"} if explicit else {}
        first = OPTIMIZERS["kflr"](model[0].parameters(), **kw)
        last = OPTIMIZERS["diag_ggn"](model[2].parameters(), **kw)
        for step in range(2):
            X, y = _data(step)
            first.zero_grad()
            last.zero_grad()
            if explicit:
                with first.collect():
                    lossfunc(model(X), y).backward()
                kept = [p.grad.clone() for p in model[0].parameters()]
                last.zero_grad()
                with last.collect():
                    lossfunc(model(X), y).backward()
                for p, g in zip(model[0].parameters(), kept):
                    p.grad = g
            else:
                lossfunc(model(X), y).backward()
                assert not hasattr(model[0].weight, "diag_ggn_exact")
                assert not hasattr(model[2].weight, "kflr")
            first.step()
            last.step()
        return _params(model)

    _assert_same(run(False), run(True))


def test_a_user_collect_of_other_quantities_coexists():
    """A user's ``collect(BatchGrad())`` around the backward: its per-sample gradients are
    right, and the optimizer's step is unchanged."""
    want = _explicit_run(_mlp, OPTIMIZERS["kflr"], steps=1)
    model = curvopt.extend(_mlp())
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    opt = OPTIMIZERS["kflr"](model.parameters())
    X, y = _data(0)
    opt.zero_grad()
    with curvopt.collect(ext.BatchGrad()):
        lossfunc(model(X), y).backward()
    for p in model.parameters():
        _assert_same(p.grad_batch.sum(0), p.grad)
    opt.step()
    _assert_same(_params(model), want)


def test_a_user_collect_of_the_same_quantity_takes_the_pass():
    """The open block writes ``p.kflr`` (the optimizer's collection stands aside), and the
    step reads it: the step of the explicit loop."""
    want = _explicit_run(_mlp, OPTIMIZERS["kflr"], steps=1)
    model = curvopt.extend(_mlp())
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    opt = OPTIMIZERS["kflr"](model.parameters())
    X, y = _data(0)
    opt.zero_grad()
    with curvopt.collect(ext.KFLR()) as block:
        lossfunc(model(X), y).backward()
    assert block.extensions[0].attr == "kflr"
    opt.step()
    _assert_same(_params(model), want)


def test_an_older_optimizer_on_the_same_parameters_raises_at_its_step():
    model = curvopt.extend(_mlp())
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    old = OPTIMIZERS["kflr"](model.parameters())
    new = OPTIMIZERS["kflr"](model.parameters())
    X, y = _data(0)
    lossfunc(model(X), y).backward()
    new.step()
    with pytest.raises(ExtensionConflictError, match="another curvopt optimizer"):
        old.step()


def test_closure_that_does_nothing_inside_opt_collect():
    """Lightning's manual optimization: ``opt.step()`` (a closure doing nothing) inside
    ``with opt.collect()``; and ``opt.step(closure)``."""
    want = _explicit_run(_mlp, OPTIMIZERS["kflr"], steps=2)
    model = curvopt.extend(_mlp())
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    opt = OPTIMIZERS["kflr"](model.parameters())
    X, y = _data(0)
    opt.zero_grad()
    with opt.collect():
        lossfunc(model(X), y).backward()
        opt.step(lambda: None)
    X, y = _data(1)

    opt.step(_closure(opt, model, lossfunc, X, y))
    _assert_same(_params(model), want)


def test_zero_grad_starts_a_new_window_as_for_p_grad():
    """``opt.zero_grad()`` or the model's ``zero_grad()`` between passes: only the passes
    after it count, as for ``p.grad``."""
    want = _explicit_run(_mlp, OPTIMIZERS["kflr"], steps=1)
    for zero_grad in ("optimizer", "model"):
        model = curvopt.extend(_mlp())
        lossfunc = curvopt.extend(nn.CrossEntropyLoss())
        opt = OPTIMIZERS["kflr"](model.parameters())
        X, y = _data(0)
        lossfunc(model(2 * X), y).backward()
        (opt if zero_grad == "optimizer" else model).zero_grad()
        lossfunc(model(X), y).backward()
        opt.step()
        _assert_same(_params(model), want)


def test_explicit_mode_collects_only_inside_opt_collect():
    model = curvopt.extend(_mlp())
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    opt = OPTIMIZERS["kflr"](model.parameters(), collection="explicit")
    X, y = _data(0)
    lossfunc(model(X), y).backward()
    assert not hasattr(model[0].weight, "kflr")
    with pytest.raises(RuntimeError, match="has no `kflr`"):
        opt.step()
    with pytest.raises(ValueError, match="collection must be"):
        OPTIMIZERS["kflr"](model.parameters(), collection="always")


def test_a_freed_optimizer_disarms_and_the_model_costs_like_the_plain_one():
    """Nothing is armed or open once the optimizer is gone (also after a deep copy of it)."""
    gc.collect()
    assert STATE.collecting is None
    model = curvopt.extend(_mlp())
    opt = OPTIMIZERS["kflr"](model.parameters())
    twin = copy.deepcopy(opt)
    assert STATE.collecting is not None and len(STATE.armed) == 2
    del opt, twin
    assert STATE.collecting is None and not STATE.armed


def test_a_collection_freed_while_the_hooks_read_the_armed_ones_hides_no_other():
    """The garbage collector can free an optimizer's collection (left in a reference cycle)
    at any allocation, also while a forward hook loops over the armed collections: the newer
    ones are still read, so the functional loss of this optimizer's pass is watched."""
    from curvopt.frontend.collection import Collection

    gc.collect()
    freed = Collection(lambda: None)
    freed.arm()
    freed.cycle = freed  # freed only by the garbage collector
    del freed
    collector = Collection(lambda: gc.collect() and None)  # its window runs the collector
    collector.arm()
    try:
        model = curvopt.extend(_mlp())
        opt = OPTIMIZERS["diag_ggn"](model.parameters())
        X, y = _data(0)
        armed = len(STATE.armed)
        torch.nn.functional.cross_entropy(model(X), y).backward()
        assert len(STATE.armed) == armed - 1  # the cycle went during the forward
        opt.step()
    finally:
        collector.disarm()
    twin = curvopt.extend(_mlp())
    twin_opt = OPTIMIZERS["diag_ggn"](twin.parameters())
    torch.nn.functional.cross_entropy(twin(X), y).backward()
    twin_opt.step()
    assert torch.equal(_params(model), _params(twin))


def test_an_optimizer_on_another_model_does_no_work_in_this_ones_backward(monkeypatch):
    """An armed optimizer whose modules have no call awaiting a gradient (another model, or
    one not yet garbage-collected) takes no part: one graph walk, that of the open block."""
    from curvopt.graph import walk as walk_module

    walks = []
    walk = walk_module.Walk._walk
    monkeypatch.setattr(walk_module.Walk, "_walk", lambda *a: walks.append(1) or walk(*a))
    other = curvopt.extend(_mlp())
    armed = OPTIMIZERS["kflr"](other.parameters())
    model = curvopt.extend(_mlp())
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    X, y = _data(0)
    with curvopt.collect(ext.DiagGGNExact()):
        lossfunc(model(X), y).backward()
    assert len(walks) == 1 and armed.collect().extensions
    assert not hasattr(other[0].weight, "kflr")


def test_levenberg_marquardt_measures_the_loss_without_collecting(monkeypatch):
    """The closure's second call (the loss after the step) computes no curvature: one
    curvature walk per step, and the explicit loop's steps."""
    from curvopt.graph import walk as walk_module
    from curvopt.optim import LevenbergMarquardt

    def run(**kw):
        model = curvopt.extend(_mlp())
        lossfunc = curvopt.extend(nn.CrossEntropyLoss())
        opt = KFAC(model.parameters(), 0.5, LevenbergMarquardt(0.1, interval=1), "kflr", **kw)
        X, y = _data(0)

        for _ in range(2):
            opt.step(_closure(opt, model, lossfunc, X, y))
        return _params(model)

    want = run(collection="explicit")
    walks = []
    walk = walk_module.Walk._walk
    monkeypatch.setattr(walk_module.Walk, "_walk", lambda *a: walks.append(1) or walk(*a))
    _assert_same(run(), want)
    assert len(walks) == 2
