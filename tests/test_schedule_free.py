"""Schedule-free averaging of the Newton optimizers (``schedule_free=β``,
``curvopt.optim.stages.schedule_free``), in float64, against Defazio et al. 2024's Algorithm 1
written out with its three sequences, and against ``schedulefree.SGDScheduleFree``."""

import copy

import pytest
import torch
from torch import nn

import curvopt
from curvopt.optim import EKFAC, KFAC, DiagGGNNewton, LevenbergMarquardt, stages


def _mlp(seed=0):
    torch.manual_seed(seed)
    return curvopt.extend(nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double())


def _cnn(seed=0):
    torch.manual_seed(seed)
    return curvopt.extend(
        nn.Sequential(
            nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(48, 3)
        ).double()
    )


def _data(model, n=10, seed=1):
    g = torch.Generator().manual_seed(seed)
    shape = (n, 6) if isinstance(model[0], nn.Linear) else (n, 2, 4, 4)
    X = torch.randn(shape, generator=g, dtype=torch.float64)
    return X, torch.randint(0, 3, (n,), generator=g)


class RecordUpdate(stages.Stage):
    """Records ``u = lr · v`` (the update the schedule-free stage receives) per parameter."""

    order = 65

    def __init__(self):
        self.updates = []

    def __call__(self, step):
        self.updates.append([item.update.delta.clone() for item in step.params])


MAKERS = {
    "KFAC": lambda p, **kw: KFAC(p, 0.3, 0.1, **kw),
    "KFAC-kflr-eigh": lambda p, **kw: KFAC(
        p, 0.3, 0.1, "kflr", kronecker_damping="trace_norm_eigh", **kw
    ),
    "DiagGGNNewton": lambda p, **kw: DiagGGNNewton(p, 0.3, 0.1, "exact", **kw),
    "EKFAC": lambda p, **kw: EKFAC(p, 0.3, 0.1, **kw),
}


def _train(make, model, steps, lrs=None, reduction="mean", **options):
    X, y = _data(model)
    lossfunc = curvopt.extend(nn.CrossEntropyLoss(reduction=reduction))
    opt = make(model.parameters(), **options)
    for t in range(steps):
        if lrs is not None:
            opt.param_groups[0]["lr"] = lrs[t]
        opt.zero_grad()
        lossfunc(model(X), y).backward()
        opt.step()
    return opt


@pytest.mark.parametrize("name", sorted(MAKERS))
@pytest.mark.parametrize("architecture", [_mlp, _cnn])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_the_iterates_are_algorithm_1s(name, architecture, reduction):
    """With the updates ``u_t`` the chain produced, the parameters are ``y_t = (1 − β) z_t +
    β x_t`` of ``z_{t+1} = z_t − u_t``, ``x_{t+1} = (1 − c) x_t + c z_{t+1}``, ``c = w_t / Σ w``,
    ``w_t = max_{s≤t} lr_s²`` (a warm-up, then a decay of the lr: the weights use the maximum),
    and ``opt.eval()`` gives ``x``, ``opt.train()`` ``y`` again."""
    beta, lrs = 0.8, [0.1, 0.2, 0.3, 0.3, 0.15, 0.05]
    model = architecture()
    start = [p.detach().clone() for p in model.parameters()]
    record = RecordUpdate()
    chain = stages.NEWTON.with_stage(record)
    opt = _train(MAKERS[name], model, len(lrs), lrs, reduction, stages=chain, schedule_free=beta)
    z, x, lr_max, weight_sum = list(start), list(start), 0.0, 0.0
    for lr, updates in zip(lrs, record.updates):
        lr_max = max(lr_max, lr)
        weight_sum += lr_max**2
        c = lr_max**2 / weight_sum
        z = [zi - u for zi, u in zip(z, updates)]
        x = [(1 - c) * xi + c * zi for xi, zi in zip(x, z)]
    y = [(1 - beta) * zi + beta * xi for zi, xi in zip(z, x)]
    params = list(model.parameters())
    assert all(torch.allclose(p, yi, rtol=1e-12, atol=1e-13) for p, yi in zip(params, y))
    assert not torch.allclose(params[0], x[0])  # y and x differ: the test can tell them apart
    trained = [p.detach().clone() for p in params]
    opt.eval()
    assert all(torch.allclose(p, xi, rtol=1e-12, atol=1e-13) for p, xi in zip(params, x))
    opt.eval()  # twice: still x
    assert all(torch.allclose(p, xi, rtol=1e-12, atol=1e-13) for p, xi in zip(params, x))
    opt.train()
    assert all(torch.allclose(p, t, rtol=1e-12, atol=1e-13) for p, t in zip(params, trained))


def test_the_first_step_is_the_plain_one():
    """``z = x = y`` at the start, so ``c = 1`` and the first step is ``u`` itself."""
    plain = _train(MAKERS["KFAC"], _mlp(), 1)
    averaged = _train(MAKERS["KFAC"], _mlp(), 1, schedule_free=0.9)
    for p, q in zip(plain.param_groups[0]["params"], averaged.param_groups[0]["params"]):
        assert torch.allclose(p, q, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("beta", [0.5, 0.9])
def test_with_the_gradient_as_direction_it_is_schedulefree_sgd(beta):
    """A chain whose direction is the gradient gives ``schedulefree.SGDScheduleFree``'s
    iterates (momentum β, its warm-up replaced by the same lr per step), and its ``eval()``."""
    schedulefree = pytest.importorskip("schedulefree")

    class Gradient(stages.Stage):
        order = 30

        def __call__(self, step):
            for item in step.params:
                item.direction = item.grad

    chain = stages.Chain((Gradient(), stages.ScaleByLearningRate(), stages.ScheduleFree()))
    ours, theirs = _mlp(), _mlp()
    X, y = _data(ours)
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    opt = DiagGGNNewton(ours.parameters(), 0.1, 1.0, stages=chain, schedule_free=beta)
    ref = schedulefree.SGDScheduleFree(
        theirs.parameters(), lr=0.1, momentum=beta, warmup_steps=4, foreach=False
    )
    ref.train()
    for k in range(7):
        opt.param_groups[0]["lr"] = 0.1 * min(1.0, (k + 1) / 4)  # its warm-up
        for model, o in ((ours, opt), (theirs, ref)):
            o.zero_grad()
            lossfunc(model(X), y).backward()
            o.step()
        for p, q in zip(ours.parameters(), theirs.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)
    opt.eval()
    ref.eval()
    for p, q in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)


def test_resuming_from_a_state_dict_continues_the_same_run():
    whole = _train(MAKERS["KFAC"], _mlp(), 5, schedule_free=0.9)
    model = _mlp()
    first = _train(MAKERS["KFAC"], model, 3, schedule_free=0.9)
    saved = first.state_dict()
    X, y = _data(model)
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    again = MAKERS["KFAC"](model.parameters(), schedule_free=0.9)
    again.load_state_dict(saved)
    for _ in range(2):
        again.zero_grad()
        lossfunc(model(X), y).backward()
        again.step()
    for p, q in zip(whole.param_groups[0]["params"], model.parameters()):
        assert torch.equal(p, q)


def test_only_the_groups_with_schedule_free_are_averaged():
    model = _mlp()
    first, second = list(model[0].parameters()), list(model[2].parameters())
    groups = [{"params": first, "schedule_free": 0.9}, {"params": second}]
    opt = _train(lambda _, **kw: KFAC(groups, 0.3, 0.1, **kw), model, 3)
    before = [p.detach().clone() for p in model.parameters()]
    opt.eval()
    assert not torch.equal(model[0].weight, before[0])
    assert all(torch.equal(p, b) for p, b in zip(second, before[2:]))


def test_without_schedule_free_eval_and_train_change_nothing():
    model = _mlp()
    opt = _train(MAKERS["KFAC"], model, 2)
    before = [p.detach().clone() for p in model.parameters()]
    opt.eval()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    opt.train()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_a_step_in_eval_mode_raises_and_changes_nothing():
    model = _mlp()
    opt = _train(MAKERS["KFAC"], model, 2, schedule_free=0.9)
    opt.eval()
    X, y = _data(model)
    curvopt.extend(nn.CrossEntropyLoss())(model(X), y).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"KFAC: step\(\) after opt.eval\(\).*opt.train\(\)"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


@pytest.mark.parametrize("beta", [0, 0.0, 1.0, -0.1, 1.5, float("nan"), True])
def test_a_bad_interpolation_raises(beta):
    with pytest.raises(ValueError, match="schedule_free must be"):
        KFAC(_mlp().parameters(), 0.1, 0.1, schedule_free=beta)


def test_adaptive_damping_does_not_combine():
    with pytest.raises(ValueError, match="schedule_free does not combine with adaptive"):
        DiagGGNNewton(_mlp().parameters(), 0.1, LevenbergMarquardt(1.0), schedule_free=0.9)


def test_the_stage_is_left_out_without_schedule_free():
    names = [
        type(s).__name__
        for s in stages.NEWTON.for_group(KFAC(_mlp().parameters(), 0.1, 0.1).param_groups[0])
    ]
    assert "ScheduleFree" not in names
    group = KFAC(_mlp().parameters(), 0.1, 0.1, schedule_free=0.9).param_groups[0]
    assert type(stages.NEWTON.for_group(group)[-1]).__name__ == "ScheduleFree"


def test_a_checkpoint_taken_in_eval_mode_resumes_at_the_training_point():
    """As the Hugging Face Trainer saves after an evaluation: the model holds ``x`` and the
    optimizer's state says so (group state ``"averaged"``), so ``train()`` after loading puts
    ``y`` back and the run continues as the uninterrupted one (to rounding: ``x`` and back;
    the exact curvature: no Monte-Carlo draws, which the reseeding model would change)."""
    whole = _train(MAKERS["KFAC-kflr-eigh"], _mlp(), 5, schedule_free=0.9)
    model = _mlp()
    first = _train(MAKERS["KFAC-kflr-eigh"], model, 3, schedule_free=0.9)
    first.eval()
    weights, saved = copy.deepcopy(model.state_dict()), copy.deepcopy(first.state_dict())
    resumed = _mlp(seed=1)
    resumed.load_state_dict(weights)
    again = MAKERS["KFAC-kflr-eigh"](resumed.parameters(), schedule_free=0.9)
    again.load_state_dict(saved)
    with pytest.raises(RuntimeError, match=r"call opt.train\(\) first"):
        again.step()
    again.train()
    X, y = _data(resumed)
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    for _ in range(2):
        again.train()  # as the Trainer calls it before every step: no swap when training
        again.zero_grad()
        lossfunc(resumed(X), y).backward()
        again.step()
    for p, q in zip(whole.param_groups[0]["params"], resumed.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-13)
    assert copy.deepcopy(again)._group_state[0].get("averaged") is False
