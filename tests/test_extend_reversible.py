"""``extend`` writes nothing onto the user's modules and parameters, and ``unextend`` takes off
every hook it installed (``curvopt.core.extended`` keeps what it installed, weakly).

References are independent of curvopt: hook counts read off torch's own hook dicts, per-sample
gradients from a loop over per-sample parameter copies (``conftest.per_sample_grads_loop``),
the behaviour of a model never extended.
"""

import copy
import gc
import io
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from conftest import DT, assert_close, per_sample_grads_loop
from torch import nn

import curvopt
from curvopt import extensions as ext
from curvopt.core import extended
from curvopt.errors import UnsupportedModuleError


class Gate(nn.Module):
    """A custom module with a raw parameter: the generic rule (which hooks its forward's start
    too, for the random state a re-run needs)."""

    def __init__(self, width):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(width))

    def forward(self, x):
        return x * torch.sigmoid(self.scale)


class Net(nn.Module):
    """Layers of every kind of hooking: plain rules, a rule that owns its children
    (``MultiheadAttention``), a custom module with raw parameters (the generic rule, with its
    pre-hook), a frozen layer, a module without parameters."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(3, 4)
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        self.custom = Gate(4)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.act = nn.Tanh()
        self.head = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))

    def forward(self, x):
        h = self.emb(x)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        h = self.act(self.frozen(self.custom(h)))
        return self.head(h).mean(1)


def _plain(seed=0):
    torch.manual_seed(seed)
    return Net().to(DT)


def _data(n=4, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 3, generator=gen, dtype=DT)
    return x, torch.randint(0, 2, (n,), generator=gen)


def _hooks(model):
    """What torch holds of hooks: per module its forward (pre-)hooks, per parameter its tensor
    hooks (``id``s of the hook functions, so that a user's own hooks are told apart)."""
    modules = {
        name: (
            [id(h) for h in m._forward_hooks.values()],
            [id(h) for h in m._forward_pre_hooks.values()],
        )
        for name, m in model.named_modules()
    }
    params = {name: list((p._backward_hooks or {}).keys()) for name, p in model.named_parameters()}
    return modules, params


def _curvopt_attributes(*objects):
    """``name.attribute`` for every attribute starting with ``_curvopt`` on the modules and
    parameters of ``objects``."""
    found = []
    for obj in objects:
        for name, m in obj.named_modules():
            found += [f"{name}.{a}" for a in vars(m) if a.startswith("_curvopt")]
        for name, p in obj.named_parameters():
            found += [f"{name}.{a}" for a in vars(p) if a.startswith("_curvopt")]
            found += [f"{name}.{a}" for a in dir(p) if a.startswith("_curvopt")]
    return found


def _batch_grads(model, lossfunc, x, y):
    for p in model.parameters():
        p.grad = None
        p.__dict__.pop("grad_batch", None)
    with curvopt.collect(ext.BatchGrad()):
        lossfunc(model(x), y).backward()
    return {n: p.grad_batch for n, p in model.named_parameters() if hasattr(p, "grad_batch")}


def test_unextend_removes_every_hook_and_keeps_the_users_own():
    model, loss = _plain(), nn.CrossEntropyLoss()
    mine = model.head[0].register_forward_hook(lambda *a: None)  # a user's hooks stay
    model.emb.weight.register_hook(lambda g: g)
    before, loss_before = _hooks(model), _hooks(loss)
    curvopt.extend(model)
    curvopt.extend(model.head, name="head")  # a submodule extended on its own too
    curvopt.extend(loss)
    assert _hooks(model) != before and _hooks(loss) != loss_before
    assert curvopt.unextend(model) is model
    assert curvopt.unextend(loss) is loss
    assert _hooks(model) == before and _hooks(loss) == loss_before
    assert len(model.head[0]._forward_hooks) == 1 and mine.id in model.head[0]._forward_hooks
    for m in (*model.modules(), loss):
        assert not extended.is_extended(m) and extended.entry_of(m) is None
    for name, p in model.named_parameters():
        assert not extended.is_extended(p) and extended.entry_of(p) is None
        if name != "emb.weight":  # as never hooked: no hook dispatcher left either
            assert p._backward_hooks is None, name


def test_unextend_of_a_module_never_extended_changes_nothing():
    model = _plain()
    before = _hooks(model)
    assert curvopt.unextend(model) is model
    assert _hooks(model) == before
    with pytest.raises(TypeError, match="unextend expects a torch.nn.Module"):
        curvopt.unextend(lambda x: x)


def test_nothing_is_written_onto_modules_or_parameters():
    model, loss = _plain(), curvopt.extend(nn.CrossEntropyLoss())
    curvopt.extend(model, sequence_first=False)
    curvopt.extend(model.attn, name="attention")
    assert _curvopt_attributes(model, loss) == []
    x, y = _data()
    _batch_grads(model, loss, x, y)  # forward and backward inside collect
    F.cross_entropy(model(x), y).backward()  # and outside it
    with curvopt.collect(ext.DiagGGNExact()):  # a functional loss read by a second order pass
        F.cross_entropy(model(x), y).backward()
    assert _curvopt_attributes(model, loss) == []
    curvopt.unextend(model)
    curvopt.unextend(loss)
    assert _curvopt_attributes(model, loss) == []


def test_extend_unextend_extend_computes_the_per_sample_gradients():
    plain = _plain()
    x, y = _data()
    reference = per_sample_grads_loop(plain, nn.CrossEntropyLoss(), x, y)
    model, loss = copy.deepcopy(plain), nn.CrossEntropyLoss()
    for _ in range(2):
        curvopt.extend(model)
        curvopt.extend(loss)
        curvopt.unextend(model)
        curvopt.unextend(loss)
    curvopt.extend(model)
    hooks = _hooks(model)
    assert curvopt.extend(model) is model  # still idempotent
    assert _hooks(model) == hooks
    curvopt.extend(loss)
    got = _batch_grads(model, loss, x, y)
    assert got.keys() == reference.keys()
    for name in reference:
        assert_close(got[name], reference[name], name)
    assert extended.path_of(model.head[2].weight) == "head.2.weight"


def test_an_unextended_model_in_collect_behaves_as_one_never_extended():
    x, y = _data()
    never, undone = _plain(), curvopt.unextend(curvopt.extend(_plain()))
    messages = []
    for model in (never, undone):
        with pytest.raises(UnsupportedModuleError, match="through nothing extended") as info:
            with curvopt.collect(ext.BatchGrad()):
                F.cross_entropy(model(x), y).backward()
        messages.append(str(info.value))
        loss = F.cross_entropy(model(x), y)  # forward outside: the block sees no call
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with curvopt.collect(ext.BatchGrad()):
                loss.backward()
        assert not any(hasattr(p, "grad_batch") for p in model.parameters())
    assert messages[0] == messages[1]
    assert_close(undone.emb.weight.grad, never.emb.weight.grad, "plain gradient")


def test_unextend_of_a_submodule_leaves_the_rest_extended():
    plain = _plain()
    x, y = _data()
    reference = per_sample_grads_loop(plain, nn.CrossEntropyLoss(), x, y)
    model = curvopt.extend(copy.deepcopy(plain))
    curvopt.unextend(model.head)
    assert not any(extended.is_extended(m) for m in model.head.modules())
    assert extended.is_extended(model.emb) and extended.is_extended(model.attn)
    with pytest.warns(UserWarning, match="is not extended"):
        got = _batch_grads(model, curvopt.extend(nn.CrossEntropyLoss()), x, y)
    assert not any(k.startswith("head.") for k in got)
    for name in got:
        assert_close(got[name], reference[name], name)


def test_a_tied_weight_keeps_its_hook_while_another_extended_module_holds_it():
    model = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5, bias=False)).to(DT)
    model[1].weight = model[0].weight
    curvopt.extend(model)
    curvopt.unextend(model[1])
    assert extended.is_extended(model[0].weight)
    assert len(model[0].weight._backward_hooks) == 1
    curvopt.unextend(model)
    assert not extended.is_extended(model[0].weight)
    assert not model[0].weight._backward_hooks


def test_an_extended_model_is_freed_and_leaves_no_entry():
    model = curvopt.extend(_plain())
    x, y = _data()
    _batch_grads(model, curvopt.extend(nn.CrossEntropyLoss()), x, y)
    keys = {id(m) for m in model.modules()} | {id(p) for p in model.parameters()}
    tables = (extended._MODULES, extended._PARAMETERS)
    assert all(keys & set(table._data) for table in tables)  # the model has entries
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None
    for table in tables:  # (other objects, made since, may reuse an id: a live entry)
        assert all(obj() is not None for obj, _ in table._data.values())


def _copies(model):
    """A deep copy and a pickled-and-loaded copy of ``model``."""
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return copy.deepcopy(model), torch.load(buffer, weights_only=False)


def test_a_copy_of_an_extended_model_is_a_plain_model_until_extended():
    plain = _plain()
    x, y = _data()
    reference = per_sample_grads_loop(plain, nn.CrossEntropyLoss(), x, y)
    extended_hooks = _hooks(curvopt.extend(copy.deepcopy(plain)))
    model = curvopt.extend(copy.deepcopy(plain))
    for twin in _copies(model):
        with pytest.raises(UnsupportedModuleError, match="through nothing extended"):
            with curvopt.collect(ext.BatchGrad()):
                F.cross_entropy(twin(x), y).backward()
        assert not any(hasattr(p, "grad_batch") for p in twin.parameters())
        curvopt.extend(twin)  # the copied hooks are replaced, not doubled
        assert [len(h) for h, _ in _hooks(twin)[0].values()] == [
            len(h) for h, _ in extended_hooks[0].values()
        ]
        got = _batch_grads(twin, curvopt.extend(nn.CrossEntropyLoss()), x, y)
        assert got.keys() == reference.keys()
        for name in reference:
            assert_close(got[name], reference[name], name)
        curvopt.unextend(twin)
        assert _hooks(twin) == _hooks(plain)
    undone = curvopt.unextend(_copies(model)[0])  # a copy never extended: its copied hooks go
    assert _hooks(undone) == _hooks(plain)


def test_extending_a_model_that_holds_a_copy_replaces_the_copied_hooks():
    plain = _plain()
    fresh = _hooks(curvopt.extend(nn.Sequential(copy.deepcopy(plain))))
    wrapped = curvopt.extend(nn.Sequential(copy.deepcopy(curvopt.extend(_plain()))))
    assert [len(h) + len(pre) for h, pre in _hooks(wrapped)[0].values()] == [
        len(h) + len(pre) for h, pre in fresh[0].values()
    ]
    curvopt.unextend(wrapped)
    assert all(not h and not pre for h, pre in _hooks(wrapped)[0].values())


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda p: curvopt.optim.KFAC(p, lr=0.1, damping=0.1, curvature="kflr", kl_clip=None),
        lambda p: curvopt.optim.DiagGGNNewton(p, lr=0.1, damping=0.1, curvature="exact"),
        lambda p: curvopt.optim.VarianceAdaptedSGD(p, lr=0.1),
    ],
    ids=["KFAC", "DiagGGNNewton", "VarianceAdaptedSGD"],
)
def test_an_optimizer_on_a_copy_of_an_extended_model_names_the_copy_and_the_fix(make_optimizer):
    """The copy is a plain model: its step raises, saying so and naming ``curvopt.extend``,
    and changes nothing; extended, the copy takes the original's step."""
    model = curvopt.extend(_plain())
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    x, y = _data()
    twin = copy.deepcopy(model)
    before = [p.detach().clone() for p in twin.parameters()]
    opt = make_optimizer(twin.parameters())
    lossfunc(twin(x), y).backward()
    with pytest.raises(RuntimeError, match=r"copy\.deepcopy of an extended model.*curvopt\.extend"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(twin.parameters(), before))

    curvopt.extend(twin)
    for net in (model, twin):
        step = make_optimizer(net.parameters())
        step.zero_grad()
        lossfunc(net(x), y).backward()
        step.step()
    assert not torch.equal(next(model.parameters()), before[0])
    for got, want in zip(twin.parameters(), model.parameters()):
        assert torch.equal(got, want)
