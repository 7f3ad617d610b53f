"""What a plain step derives from the cached state is kept between refreshes (``plan.Prepared``).

``KFAC`` keeps each parameter's inverse resolved for its products, ``EKFAC`` its ``S + λ`` and
the trust region's ``K + λ``. Kept across a change they would give wrong steps; so in float64 a
run that keeps them takes, bit for bit, the steps of the same run with the cache emptied before
every step (every step derives everything anew, as a rebuilt optimizer does), through a
refresh, a new learning rate, a new damping, a loaded ``state_dict``, ``add_param_group`` and a
move of the model to another dtype. The cache is seen to be used on the plain steps between
(the same objects as at the step before) and to be formed anew after each change.
"""

import copy

import pytest
import torch
from conftest import free_earlier_optimizers
from torch import nn

import curvopt
from curvopt.optim import EKFAC, KFAC

OPTIMIZERS = {"KFAC": KFAC, "EKFAC": EKFAC}
STEPS = 14
#: step -> what changes before it (both runs alike)
EVENTS = {4: "lr", 5: "load", 7: "add_param_group", 8: "dtype", 10: "damping"}
#: the steps at which the first group derives anew: its refreshes (every 3 steps) and the
#: changes above but a new learning rate (no derived quantity depends on it) and a new group
#: (whose own first step refreshes its own parameters only); ``EKFAC`` also at step 1, where
#: its first basis is put to use
ANEW = {0, 3, 5, 6, 8, 9, 10, 12}


@pytest.fixture(autouse=True)
def _no_other_optimizer():
    """Optimizers of earlier tests, in reference cycles, are freed: an awake one would collect."""
    free_earlier_optimizers()


def _model():
    """Float64: a layer whose input side has a Woodbury form (12 inputs, batch 5) and dense
    layers; the last one joins the optimizer later (``add_param_group``)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 6), nn.Tanh(), nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 3))


def _batches():
    generator = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(5, 12, generator=generator, dtype=torch.float64),
            torch.randint(0, 3, (5,), generator=generator),
        )
        for _ in range(STEPS)
    ]


def _kept(opt) -> dict:
    """What the cache keeps per parameter: ``id(param)`` (the inverse) or ``(id(param), what)``
    (``EKFAC``'s trust metric) ``->`` the object. A group's entry (``("inverses", ·)``,
    ``("trust_metrics", ·)``) holds one object per parameter, the parameters its first
    sources."""
    prepared = opt.__dict__.get("_prepared_steps")
    out = {}
    for key, (sources, _, value) in ({} if prepared is None else prepared._kept).items():
        if key[0] == "inverses":  # KFAC: (inverse, entries); EKFAC: the inverse
            for param, derived in zip(sources, value):
                out[id(param)] = derived[0] if isinstance(derived, tuple) else derived
        elif key[0] == "trust_metrics":
            for param, derived in zip(sources, value):
                if derived is not None:
                    out[(id(param), "trust_metric")] = derived
    return out


def _run(name: str, emptied: bool):
    """The parameters after every step; per step the keys of :func:`_kept` whose objects are
    those of the step before (the cache used); the ids of the first group's parameters; per
    step the keys kept. ``emptied``: the cache emptied before every step."""
    model = curvopt.extend(_model().double())
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    head = list(model[4].parameters())
    body = [p for p in model.parameters() if all(p is not q for q in head)]
    # EKFAC: the trust region in the GGN's metric after the new damping too (K + λ kept)
    options = {"trust_metric": "ggn"} if name == "EKFAC" else {}
    opt = OPTIMIZERS[name](body, lr=0.1, curvature_interval=3, **options)
    trajectory, reused, keys, before = [], [], [], {}
    for step, (X, y) in enumerate(_batches()):
        event = EVENTS.get(step)
        if event == "lr":
            opt.param_groups[0]["lr"] = 0.05
        elif event == "damping":
            opt.param_groups[0]["damping"] = 0.03
        elif event == "load":
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        elif event == "add_param_group":
            opt.add_param_group({"params": head})
        elif event == "dtype":
            model.float()
        if emptied:
            opt.__dict__.pop("_prepared_steps", None)
        opt.zero_grad()
        lossfunc(model(X.to(model[0].weight.dtype)), y).backward()
        opt.step()
        trajectory.append([p.detach().clone() for p in model.parameters()])
        kept = _kept(opt)
        reused.append({key for key, value in kept.items() if before.get(key) is value})
        keys.append(set(kept))
        before = kept
    return trajectory, reused, [id(p) for p in body], keys


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_kept_steps_are_those_derived_anew_through_every_change(name):
    kept, reused, body, kept_keys = _run(name, emptied=False)
    anew, *_ = _run(name, emptied=True)
    for step, (ours, theirs) in enumerate(zip(kept, anew)):
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b), f"{name}: step {step} differs from the one derived anew"
    for step in range(STEPS):
        if step in ANEW or (name == "EKFAC" and step == 1):  # (the inverses: always in use)
            assert not reused[step] & set(body), f"{name}: step {step} kept stale objects"
        else:
            keys = {
                key
                for key in kept_keys[step]
                if (key[0] if isinstance(key, tuple) else key) in body
            }
            assert set(body) <= keys <= reused[step], f"{name}: plain step {step} derived anew"


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_kept_step_is_that_of_an_optimizer_rebuilt_from_its_state(name):
    """After plain steps, the next step of the optimizer equals, bit for bit, that of a new one
    loaded from its state (which derives everything anew) on the same gradients."""
    model = curvopt.extend(_model().double())
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    opt = OPTIMIZERS[name](model.parameters(), lr=0.1, curvature_interval=4)
    batches = _batches()
    for X, y in batches[:6]:
        opt.zero_grad()
        lossfunc(model(X), y).backward()
        opt.step()
    rebuilt = OPTIMIZERS[name](model.parameters(), lr=0.1, curvature_interval=4)
    rebuilt.load_state_dict(opt.state_dict())
    start = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    lossfunc(model(batches[6][0]), batches[6][1]).backward()  # step 6: a plain one
    opt.step()
    ours = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p, value in zip(model.parameters(), start):
            p.copy_(value)
    rebuilt.step()
    assert _kept(rebuilt) and _kept(opt)
    for a, b in zip(ours, model.parameters()):
        assert torch.equal(a, b)
