"""The recipe "add an optimizer stage" of ``docs/extending.md``, followed with a toy stage.

A stage is one ``Stage`` subclass with an ``order`` and ``__call__(step)``; the chain of stages
is a value (``stages.Chain``): an optimizer class declares it (``stages = ...``, in curvopt
``stages.NEWTON``), and ``stages=`` replaces it for one optimizer. The toy here halves the
update between momentum (50) and the learning rate (60) in param groups that ask for it
(``toy_halve=True``) and counts its steps in the parameters' state, so it shows all a stage
touches: the chain's order, the group's hyper-parameters, the old and the new state. No other
optimizer in the process changes.
"""

import pytest
import torch
from torch import nn

import curvopt
from curvopt.optim import KFAC, DiagGGNNewton, stages


class HalveUpdate(stages.Stage):
    """``d ← d / 2`` where ``group["toy_halve"]``; ``state["toy_count"]`` counts its steps."""

    order = 55

    def __call__(self, step):
        if not step.group.get("toy_halve", False):
            return
        for item in step.params:
            item.direction = item.direction * 0.5
            item.update.state["toy_count"] = item.state.get("toy_count", 0) + 1


HALVING = stages.NEWTON.with_stage(HalveUpdate())


class HalvingKFAC(KFAC):
    """An optimizer class declaring its own chain."""

    stages = HALVING


def _train(make, halve, steps=3):
    torch.manual_seed(0)
    model = curvopt.extend(nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double())
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    group = {"params": list(model.parameters())}
    if halve:
        group["toy_halve"] = True
    opt = make([group])
    generator = torch.Generator().manual_seed(1)
    torch.manual_seed(2)
    for _ in range(steps):
        X = torch.randn(6, 4, generator=generator, dtype=torch.float64)
        y = torch.randint(0, 3, (6,), generator=generator)
        opt.zero_grad()
        with opt.collect():
            lossfunc(model(X), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt


def test_the_stage_runs_at_its_place_in_the_chain():
    names = [type(s).__name__ for s in HALVING]
    assert names == [
        "AddWeightDecay",
        "AverageCurvature",
        "Precondition",
        "ScaleByTrustRegion",
        "TraceMomentum",
        "HalveUpdate",
        "Orthogonalize",
        "ScaleByLearningRate",
        "ScheduleFree",
    ]
    assert "HalveUpdate" not in [type(s).__name__ for s in stages.NEWTON]  # a new value


MAKERS = {
    "KFAC": lambda p, lr, **kw: KFAC(p, lr, 0.1, "kflr", momentum=0.9, kl_clip=None, **kw),
    "DiagGGNNewton": lambda p, lr, **kw: DiagGGNNewton(
        p, lr, 0.1, "exact", 0.01, kl_clip=None, **kw
    ),
    "HalvingKFAC": lambda p, lr, **kw: HalvingKFAC(
        p, lr, 0.1, "kflr", momentum=0.9, kl_clip=None, **kw
    ),
}


@pytest.mark.parametrize("name", ["KFAC", "DiagGGNNewton"])
def test_a_chain_passed_to_the_constructor_changes_that_optimizers_step(name):
    """Halving after momentum is the step with half the learning rate (exactly: ``/2`` is
    exact in binary); groups that do not ask for it take the usual step; the stage's state is
    kept with the parameter's and read back at the next step; an optimizer made without the
    chain is unchanged."""
    make = MAKERS[name]
    halved, opt = _train(lambda groups: make(groups, 0.4, stages=HALVING), halve=True)
    half_lr, _ = _train(lambda groups: make(groups, 0.2), halve=False)
    for a, b in zip(halved, half_lr):
        assert torch.equal(a, b)
    assert all(state["toy_count"] == 3 for state in opt.state.values())
    plain, plain_opt = _train(lambda groups: make(groups, 0.4), halve=True)
    assert not any(torch.equal(a, b) for a, b in zip(plain, halved))
    assert all("toy_count" not in state for state in plain_opt.state.values())


def test_a_class_declares_its_chain():
    halved, _ = _train(lambda groups: MAKERS["HalvingKFAC"](groups, 0.4), halve=True)
    half_lr, _ = _train(lambda groups: MAKERS["KFAC"](groups, 0.2), halve=False)
    for a, b in zip(halved, half_lr):
        assert torch.equal(a, b)
    plain, _ = _train(lambda groups: MAKERS["HalvingKFAC"](groups, 0.4, stages=stages.NEWTON), True)
    assert not any(torch.equal(a, b) for a, b in zip(plain, halved))


def test_two_stages_cannot_share_an_order():
    class Clash(stages.Stage):
        order = HalveUpdate.order

        def __call__(self, step):
            pass

    with pytest.raises(ValueError, match="Clash: HalveUpdate already runs at order 55"):
        HALVING.with_stage(Clash())
    with pytest.raises(ValueError, match="strictly increasing order"):
        stages.Chain((HalveUpdate(), stages.AddWeightDecay()))
    with pytest.raises(TypeError, match="stages must be a curvopt.optim.stages.Chain"):
        KFAC(nn.Linear(2, 2).parameters(), 0.1, 0.1, stages=[HalveUpdate()])
