"""The stages change the tensor being transformed in place only where the step owns it
(``stages.base.ParamStep.own``): never the gradient, the parameter or a tensor a state keeps,
and with the numbers of the out-of-place path."""

import contextlib

import pytest
import torch
from torch import nn

import curvopt
from curvopt.optim import KFAC, DiagGGNNewton, stages
from curvopt.optim.stages.trust_region import kl_clip_factor

DT = torch.float64


def _mlp(seed=0):
    torch.manual_seed(seed)
    return curvopt.extend(nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double())


def _train(model, steps, lr=0.3, **options):
    g = torch.Generator().manual_seed(1)
    X, y = torch.randn(10, 6, generator=g, dtype=DT), torch.randint(0, 3, (10,), generator=g)
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    torch.manual_seed(2)  # KFAC's Monte-Carlo columns
    opt = KFAC(model.parameters(), lr, 0.1, **options)
    for _ in range(steps):
        opt.zero_grad()
        lossfunc(model(X), y).backward()
        opt.step()
    return opt


class Disown(stages.Stage):
    """Replaces each direction by a copy the step does not own: the out-of-place path."""

    order = 31

    def __call__(self, step):
        for item in step.params:
            item.direction = item.direction.clone()


class Memory(stages.Stage):
    """Records, per parameter, the memory of the tensor being transformed at its order."""

    def __init__(self, order):
        self.order, self.seen = order, []

    def __call__(self, step):
        tensors = [i.direction if self.order < 60 else i.update.delta for i in step.params]
        self.seen.append([t.data_ptr() for t in tensors])


OPTIONS = {
    "trust region": {"kl_clip": 1e-4},
    "schedule-free": {"kl_clip": 1e-4, "schedule_free": 0.9},
    "momentum": {"kl_clip": 1e-4, "momentum": 0.9},
}


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_in_place_and_out_of_place_give_the_same_parameters(name):
    """Bit for bit: the same operations on the step's own tensor or on a copy."""
    own, copied = _mlp(), _mlp()
    _train(own, 4, **OPTIONS[name])
    _train(copied, 4, stages=stages.NEWTON.with_stage(Disown()), **OPTIONS[name])
    for p, q in zip(own.parameters(), copied.parameters()):
        assert torch.equal(p, q)


def test_the_preconditioned_direction_becomes_the_update_in_place():
    """With the trust region active and schedule-free averaging, the update ``Δ`` is the
    tensor the preconditioner made (no new tensor of the parameter's size after it)."""
    before, after = Memory(35), Memory(75)
    chain = stages.NEWTON.with_stage(before).with_stage(after)
    opt = _train(_mlp(), 3, stages=chain, **OPTIONS["schedule-free"])
    assert before.seen == after.seen
    assert len({p for step in before.seen for p in step}) > 4  # new tensors at every step
    state = next(iter(opt.state.values()))
    assert "schedule_free" in state


def test_momentum_keeps_the_velocity_unscaled():
    """At the first step ``v = d``: the stored velocity does not depend on the lr (it would be
    ``lr · d`` if the lr stage scaled it in place)."""
    velocities = []
    for lr in (0.1, 0.4):
        model = _mlp()
        opt = _train(model, 1, lr, momentum=0.9, kl_clip=None)
        velocities.append([opt.state[p]["momentum"] for p in model.parameters()])
    for v, w in zip(*velocities):
        assert torch.equal(v, w)


@pytest.mark.parametrize("schedule_free", [None, 0.9])
def test_a_direction_that_is_the_gradient_is_not_changed_in_place(schedule_free):
    """``fallback='sgd'`` makes the gradient itself the direction: ``p.grad`` is left as it
    was by the trust region, the lr and the schedule-free stages."""
    p = nn.Parameter(torch.linspace(-1.0, 1.0, 5, dtype=DT))
    opt = DiagGGNNewton(
        [p], lr=0.5, damping=1e-2, fallback="sgd", kl_clip=1e-4, schedule_free=schedule_free
    )
    opt.collect = contextlib.nullcontext
    for step in range(3):
        start = p.detach().clone()
        p.grad = torch.linspace(1.0, 3.0, 5, dtype=DT) * (step + 1)
        grad = p.grad.clone()
        opt.step()
        assert torch.equal(p.grad, grad)
        assert not torch.equal(p.detach(), start)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_the_trust_region_factor_against_the_sum_of_products(dtype):
    """``ν = min(1, sqrt(κ / (lr² Σ g·d)))``: the products and their sum in at least float32
    (exact products for bfloat16), also for a transposed (non-contiguous) gradient."""
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(7, 4, generator=g).t(), torch.randn(3, generator=g)]
    directions = [2 * grads[0] + 0.1, 3 * grads[1]]
    grads, directions = [t.to(dtype) for t in grads], [t.to(dtype) for t in directions]
    total = sum((a.double() * b.double()).sum() for a, b in zip(grads, directions))
    lr, kl_clip = 0.3, 1e-3
    expected = min(1.0, (kl_clip / (lr**2 * float(total))) ** 0.5)
    assert expected < 1.0  # the clip is active: the test sees the product
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    assert kl_clip_factor(grads, directions, lr, kl_clip) == pytest.approx(expected, rel=tol)
