"""What a plain step keeps per param group (``optim.plan.Prepared``) is formed anew after every
change that it depends on.

``KFAC`` keeps its group's inverses, ``EKFAC`` its ``S + λ`` and trust metrics ``K + λ`` in one
entry per group, the optimizer its parameters' descriptions and whether any is sharded. In
float64 a run that keeps them takes, bit for bit, the steps of the same run with the cache
emptied before every step (all derived anew, as a rebuilt optimizer does) through a gradient
that is None for one step, a parameter whose ``requires_grad`` is switched off and on again, a
new group option (``KFAC``'s ``kronecker_damping``, ``EKFAC``'s ``weight_decay``) and the
refreshes; the group's entry is seen to be used on the plain steps between (the same object as
at the step before) and formed anew at each change. (A new learning rate, damping, dtype,
loaded ``state_dict`` and ``add_param_group``: ``test_prepared_steps``.)
"""

import pytest
import torch
from conftest import free_earlier_optimizers
from test_prepared_steps import _batches as batches
from torch import nn

import curvopt
from curvopt.optim import EKFAC, KFAC, base

OPTIMIZERS = {"KFAC": KFAC, "EKFAC": EKFAC}
STEPS = 12
#: the refreshes (``curvature_interval=5``)
REFRESHES = {0, 5, 10}
#: step -> what changes at it (both runs alike)
EVENTS = {2: "grad None", 3: "grad back", 6: "frozen", 7: "thawed", 9: "option"}
#: the group option changed: one that the kept entry depends on (``EKFAC``: ``λ + δ``)
OPTION = {"KFAC": ("kronecker_damping", "trace_norm_eigh"), "EKFAC": ("weight_decay", 1e-3)}


@pytest.fixture(autouse=True)
def _no_other_optimizer():
    """Optimizers of earlier tests, in reference cycles, are freed: an awake one would collect."""
    free_earlier_optimizers()


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 6), nn.Tanh(), nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 3))
    return curvopt.extend(model.double())


def _group_entry(opt):
    """The object a group's entry keeps (``("inverses", id(group))``), or None."""
    prepared = opt.__dict__.get("_prepared_steps")
    kept = prepared._kept.get(("inverses", id(opt.param_groups[0]))) if prepared else None
    return None if kept is None else kept[2]


def _run(name: str, emptied: bool):
    """The parameters after every step and whether the group's entry was that of the step
    before; ``emptied``: the cache emptied before every step."""
    model, lossfunc = _model(), curvopt.extend(nn.CrossEntropyLoss())
    opt = OPTIMIZERS[name](model.parameters(), lr=0.1, curvature_interval=5)
    trajectory, reused, before = [], [], None
    for step, (X, y) in zip(range(STEPS), batches()):  # (its first STEPS batches)
        event = EVENTS.get(step)
        if event == "frozen":
            model[2].bias.requires_grad_(False)
        elif event == "thawed":
            model[2].bias.requires_grad_(True)
        elif event == "option":
            option, value = OPTION[name]
            opt.param_groups[0][option] = value
        if emptied:
            opt.__dict__.pop("_prepared_steps", None)
        opt.zero_grad()
        lossfunc(model(X), y).backward()
        if event == "grad None":
            model[0].bias.grad = None
        opt.step()
        trajectory.append([p.detach().clone() for p in model.parameters()])
        entry = _group_entry(opt)
        reused.append(entry is not None and entry is before)
        before = entry
    return trajectory, reused


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_kept_group_entry_gives_the_steps_derived_anew_through_every_change(name):
    kept, reused = _run(name, emptied=False)
    anew, _ = _run(name, emptied=True)
    for step, (ours, theirs) in enumerate(zip(kept, anew)):
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b), f"{name}: step {step} differs from the one derived anew"
    assert any(not torch.equal(a, b) for a, b in zip(kept[1], kept[2]))  # the steps move
    fresh = REFRESHES | set(EVENTS) | ({1} if name == "EKFAC" else set())  # (its first basis)
    for step in range(STEPS):
        expected = step not in fresh
        assert reused[step] == expected, f"{name}: step {step}: kept {reused[step]}"


def test_the_descriptions_follow_the_names_and_shapes():
    model = _model()
    opt = KFAC(model.named_parameters(), lr=0.1)
    group = opt.param_groups[0]
    first = opt._descriptions(group)
    assert first is opt._descriptions(group)  # kept
    assert first == [opt._describe(group, i, p) for i, p in enumerate(group["params"])]
    group["param_names"][0] = "renamed"  # in place
    assert opt._descriptions(group)[0] == "parameter 'renamed' (shape (6, 12))"
    model[4].bias.data = torch.zeros(2, dtype=torch.float64)
    assert opt._descriptions(group)[-1] == "parameter '4.bias' (shape (2,))"
    opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))], "param_names": ["extra"]})
    assert opt._descriptions(opt.param_groups[1]) == ["parameter 'extra' (shape (3,))"]


def test_whether_a_parameter_is_sharded_is_asked_again_for_other_parameters(monkeypatch):
    model = _model()
    opt = KFAC(model.parameters(), lr=0.1)
    params = list(model.parameters())
    assert opt._any_sharded(params) is False
    extra = nn.Parameter(torch.zeros(3))
    monkeypatch.setattr(base, "is_sharded", lambda p: p is extra)
    assert opt._any_sharded(params) is False  # kept: the same parameters
    assert opt._any_sharded([*params, extra]) is True
