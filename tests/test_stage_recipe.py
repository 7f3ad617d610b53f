"""The recipe "add an optimizer stage" of ``docs/architecture.md``, followed with a toy stage.

A stage is one ``Stage`` subclass with an ``order`` and ``__call__(step)``, registered with
``@register`` (in curvopt: one module in ``curvopt/optim/stages/``). The toy here halves the
update between momentum (50) and the learning rate (60) in param groups that ask for it
(``toy_halve=True``) and counts its steps in the parameters' state, so it shows all a stage
touches: the chain's order, the group's hyper-parameters, the old and the new state.
"""

import pytest
import torch
from torch import nn

import curvopt
from curvopt.optim import KFAC, DiagGGNNewton, stages
from curvopt.optim.stages import base


class HalveUpdate(stages.Stage):
    """``d ← d / 2`` where ``group["toy_halve"]``; ``state["toy_count"]`` counts its steps."""

    order = 55

    def __call__(self, step):
        if not step.group.get("toy_halve", False):
            return
        for item in step.params:
            item.direction = item.direction * 0.5
            item.update.state["toy_count"] = item.state.get("toy_count", 0) + 1


@pytest.fixture
def registered(monkeypatch):
    """The toy stage registered for one test (the registry is restored afterwards)."""
    monkeypatch.setattr(base, "_REGISTRY", list(base._REGISTRY))
    stages.register(HalveUpdate)
    return HalveUpdate


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


def test_the_stage_runs_at_its_place_in_the_chain(registered):
    names = [type(s).__name__ for s in stages.chain()]
    assert names == [
        "AddWeightDecay",
        "AverageCurvature",
        "Precondition",
        "ScaleByTrustRegion",
        "TraceMomentum",
        "HalveUpdate",
        "ScaleByLearningRate",
    ]


@pytest.mark.parametrize(
    "make",
    [
        lambda p, lr: KFAC(p, lr, 0.1, "kflr", momentum=0.9, kl_clip=None),
        lambda p, lr: DiagGGNNewton(p, lr, 0.1, "exact", 0.01, kl_clip=None),
    ],
    ids=["KFAC", "DiagGGNNewton"],
)
def test_a_registered_stage_changes_the_step_of_every_newton_optimizer(registered, make):
    """Halving after momentum is the step with half the learning rate (exactly: ``/2`` is
    exact in binary); groups that do not ask for it take the usual step; the stage's state is
    kept with the parameter's and read back at the next step."""
    halved, opt = _train(lambda groups: make(groups, 0.4), halve=True)
    half_lr, _ = _train(lambda groups: make(groups, 0.2), halve=False)
    for a, b in zip(halved, half_lr):
        assert torch.equal(a, b)
    assert all(state["toy_count"] == 3 for state in opt.state.values())
    plain, plain_opt = _train(lambda groups: make(groups, 0.4), halve=False)
    assert not any(torch.equal(a, b) for a, b in zip(plain, halved))
    assert all("toy_count" not in state for state in plain_opt.state.values())


def test_two_stages_cannot_share_an_order(registered):
    class Clash(stages.Stage):
        order = HalveUpdate.order

        def __call__(self, step):
            pass

    with pytest.raises(ValueError, match="Clash: another stage already runs at order 55"):
        stages.register(Clash)
