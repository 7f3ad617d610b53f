"""A second-order value of an earlier ``collect`` is taken off its parameter when the next pass
that replaces it reaches its curvature (``Accumulator.release``): it is not held beside the new
one (the peak memory of a training loop), a failed pass leaves no stale value, a value the user
kept is untouched, and passes of one ``collect`` still combine."""

import gc
import weakref

import pytest
import torch
from conftest import DT, assert_close
from torch import nn

import curvopt
from curvopt import extensions as ext

EXTENSIONS = {"kfac": ext.KFAC, "kflr": ext.KFLR, "diag_ggn_exact": ext.DiagGGNExact}


def _model():
    torch.manual_seed(0)
    return curvopt.extend(
        nn.Sequential(
            nn.Conv2d(2, 3, 3, padding=1),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(48, 5),
            nn.Tanh(),
            nn.Linear(5, 3),
        ).to(DT)
    )


def _data(n=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2, 4, 4, generator=g, dtype=DT), torch.randint(0, 3, (n,), generator=g)


def _pass(model, lossfunc, attr, x, y, hook=None):
    output = model(x)
    if hook is not None:
        output.register_hook(hook)  # runs after the loss hook, before the layers' hooks
    with curvopt.collect(EXTENSIONS[attr]()):
        lossfunc(output, y).backward()


def _tensors(value):
    return [value] if isinstance(value, torch.Tensor) else list(value)


@pytest.mark.parametrize("attr", list(EXTENSIONS))
def test_replaced_value_is_not_held_during_the_next_pass(attr):
    model, lossfunc = _model(), curvopt.extend(nn.CrossEntropyLoss())
    _pass(model, lossfunc, attr, *_data())
    refs = [weakref.ref(t) for p in model.parameters() for t in _tensors(getattr(p, attr))]
    alive = []
    _pass(
        model,
        lossfunc,
        attr,
        *_data(seed=2),
        hook=lambda g: alive.append(sum(r() is not None for r in refs)),
    )
    assert alive and not any(alive)  # (the hook also runs as the curvature's columns pass)
    for p in model.parameters():
        assert all(t.isfinite().all() for t in _tensors(getattr(p, attr)))


def test_failed_pass_leaves_no_stale_value():
    model, lossfunc = _model(), curvopt.extend(nn.CrossEntropyLoss())
    _pass(model, lossfunc, "kfac", *_data())

    def boom(grad):
        raise ValueError("user hook failed")

    with pytest.raises(ValueError, match="user hook failed"):
        _pass(model, lossfunc, "kfac", *_data(seed=2), hook=boom)
    assert not any(hasattr(p, "kfac") for p in model.parameters())
    _pass(model, lossfunc, "kfac", *_data(seed=2))  # and the next pass writes them
    assert all(hasattr(p, "kfac") for p in model.parameters())


def test_kept_value_is_untouched():
    model, lossfunc = _model(), curvopt.extend(nn.CrossEntropyLoss())
    _pass(model, lossfunc, "kflr", *_data())
    kept = {name: list(p.kflr) for name, p in model.named_parameters()}
    copies = {name: [t.clone() for t in value] for name, value in kept.items()}
    _pass(model, lossfunc, "kflr", *_data(seed=2))
    for name, p in model.named_parameters():
        assert all(torch.equal(a, b) for a, b in zip(kept[name], copies[name]))
        assert not any(a is b for a, b in zip(kept[name], p.kflr))


def test_parameters_the_pass_does_not_reach_keep_their_value():
    torch.manual_seed(0)
    trunk, heads = nn.Linear(3, 4).to(DT), nn.ModuleList([nn.Linear(4, 2).to(DT) for _ in "ab"])
    curvopt.extend(nn.ModuleDict({"trunk": trunk, "heads": heads}))
    lossfunc = curvopt.extend(nn.MSELoss())
    x, y = torch.randn(5, 3, dtype=DT), torch.randn(5, 2, dtype=DT)
    for head in heads:
        with curvopt.collect(ext.DiagGGNExact()):
            lossfunc(head(trunk(x)), y).backward()
    kept = heads[0].weight.diag_ggn_exact
    with curvopt.collect(ext.DiagGGNExact()):
        lossfunc(heads[1](trunk(x)), y).backward()
    assert heads[0].weight.diag_ggn_exact is kept


def test_passes_of_one_collect_still_combine():
    """Two backward passes in one ``collect`` (gradient accumulation): the diagonal GGN of a
    ``reduction="sum"`` loss adds up to that of the two batches in one pass."""
    model, lossfunc = _model(), curvopt.extend(nn.CrossEntropyLoss(reduction="sum"))
    (x1, y1), (x2, y2) = _data(), _data(seed=2)
    _pass(model, lossfunc, "diag_ggn_exact", torch.cat([x1, x2]), torch.cat([y1, y2]))
    whole = {name: p.diag_ggn_exact.clone() for name, p in model.named_parameters()}
    with curvopt.collect(ext.DiagGGNExact()):
        for x, y in ((x1, y1), (x2, y2)):
            lossfunc(model(x), y).backward()
    gc.collect()
    for name, p in model.named_parameters():
        assert_close(p.diag_ggn_exact, whole[name], name)
