"""A resting model carries no hooks, and rests by its own optimizers (``frontend.resting``).

While every armed collection covering a model rests (its optimizer's next step refreshes no
curvature) and no block is open, curvopt's forward hooks are out of the model's modules' hook
dicts and its tensor hooks out of the parameters', and they come back, where they were among
the user's own hooks, as soon as one may act. Checked by reading torch's hook dicts, and in
float64: the steps of two optimizers on two models, each resting by its own schedule, equal
bit for bit those of each run alone; a generator's steps through a resting discriminator
equal those through an awake one; per-sample gradients through the user's hooks after a rest
equal those of a model that never rested.
"""

import copy
import gc
import io
import pickle
import sys

import pytest
import torch
from torch import nn

import curvopt
from curvopt.core.state import STATE
from curvopt.frontend.hooks import _HOOKS, is_extended
from curvopt.optim import KFAC

DT = torch.float64


def _model(seed=0, width=6):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, width), nn.Tanh(), nn.Linear(width, 3)).to(DT)


def _batch(step, n=8):
    generator = torch.Generator().manual_seed(100 + step)
    X = torch.randn(n, 5, dtype=DT, generator=generator)
    return X, torch.randint(0, 3, (n,), generator=generator)


def _ours(module) -> int:
    """curvopt's hooks in ``module``'s forward (pre-)hook dicts."""
    hooks = (*module._forward_hooks.values(), *module._forward_pre_hooks.values())
    return sum(getattr(h, "func", h) in _HOOKS for h in hooks)


def _hooked(model) -> list:
    """Per extended module of ``model`` (and its root), curvopt's hooks on it; then whether
    each parameter has a tensor hook."""
    return [_ours(m) for m in model.modules()] + [
        p._backward_hooks is not None and len(p._backward_hooks) > 0 for p in model.parameters()
    ]


def _awake(model):
    return [1, 1, 0, 1] + [True] * 4  # the root's watcher, the Linears' hooks, every parameter


def _resting(model):
    return [0] * 4 + [False] * 4


def _train(model, lossfunc, opt, step):
    opt.zero_grad()
    X, y = _batch(step)
    lossfunc(model(X), y).backward()
    opt.step()


def test_hooks_are_off_while_resting_and_back_when_woken():
    model, lossfunc = curvopt.extend(_model()), curvopt.extend(nn.CrossEntropyLoss())
    opt = KFAC(model.parameters(), lr=0.1, damping=0.1, curvature_interval=3)
    for step in range(7):
        opt.zero_grad()
        refreshes = step % 3 == 0
        assert _hooked(model) == (_awake(model) if refreshes else _resting(model)), step
        assert _ours(lossfunc) == refreshes
        X, y = _batch(step)
        lossfunc(model(X), y).backward()
        opt.step()
    assert is_extended(model[0]) and is_extended(model[0].weight)  # resting
    del opt
    gc.collect()
    assert _hooked(model) == _awake(model) and _ours(lossfunc) == 1  # nothing armed: back


def test_a_resting_model_computes_what_the_plain_model_computes():
    plain = _model()
    model, lossfunc = curvopt.extend(copy.deepcopy(plain)), curvopt.extend(nn.CrossEntropyLoss())
    opt = KFAC(model.parameters(), lr=0.0, curvature_interval=10)
    _train(model, lossfunc, opt, 0)
    X, y = _batch(1)
    nn.CrossEntropyLoss()(plain(X), y).backward()
    opt.zero_grad()
    lossfunc(model(X), y).backward()
    for p, q in zip(plain.parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0)


def _user_hooks(model, log, stage):
    """Hooks of the user on ``model[0]`` and on its weight, each noting ``stage`` in ``log``: a
    forward hook, one ``prepend=True``, a pre-hook (``prepend=True``), a tensor hook. (None
    changes a value: curvopt's rules check that what they read is the module's own output and
    gradient, and a hook replacing either fails that check wherever it stands.)"""
    layer = model[0]
    layer.register_forward_hook(lambda m, a, out: log.append("forward " + stage))
    layer.register_forward_hook(lambda m, a, out: log.append("first " + stage), prepend=True)
    layer.register_forward_pre_hook(lambda m, a: log.append("pre " + stage), prepend=True)
    layer.weight.register_hook(lambda g: log.append("grad " + stage))


def _kind(hook) -> str:
    """``"curvopt"`` for a hook of curvopt's (a forward hook, a parameter's tensor hook), else the
    user's hook's name."""
    ours = getattr(hook, "func", hook) in _HOOKS or hook.__qualname__.startswith("parameter_hook")
    return "curvopt" if ours else hook.__name__


def _order(model) -> list:
    """Which of the hooks on ``model[0]`` and on its weight are curvopt's, in the order torch
    runs them."""
    layer = model[0]
    hooks = (layer._forward_pre_hooks, layer._forward_hooks, layer.weight._backward_hooks)
    return [[_kind(h) for h in d.values()] for d in hooks]


def test_the_users_hooks_keep_their_order():
    """User hooks registered before ``extend``, after it, and while the model rests: after the
    rest curvopt's hooks are where a model that never rested has them (registered before
    ``extend``: before curvopt's; after: behind them; ``prepend=True``: in front), torch runs
    them in the same order, and the per-sample gradients are the same."""
    runs = []
    for rests in (True, False):
        log = []
        model = _model()
        _user_hooks(model, log, "before")
        curvopt.extend(model)
        lossfunc = curvopt.extend(nn.CrossEntropyLoss())
        opt = KFAC(model.parameters(), lr=0.0, curvature_interval=2) if rests else None
        if rests:
            _train(model, lossfunc, opt, 0)
            assert _ours(model[0]) == 0
        _user_hooks(model, log, "while")
        if rests:
            _train(model, lossfunc, opt, 1)  # its refresh window starts: the hooks come back
            assert _ours(model[0]) == 1
        X, y = _batch(2)
        log.clear()
        with curvopt.collect(curvopt.extensions.BatchGrad()):
            model.zero_grad()
            lossfunc(model(X), y).backward()
        runs.append((_order(model), list(log), model[0].weight.grad_batch))
        del opt
        gc.collect()
    (order, log, batch), (twin_order, twin_log, twin_batch) = runs
    assert order == twin_order and log == twin_log
    lam = "<lambda>"
    assert order == [[lam, lam], [lam, lam, lam, "curvopt", lam], [lam, "curvopt", lam]]
    assert log == [
        "pre while", "pre before", "first while", "first before", "forward before",
        "forward while", "grad before", "grad while",
    ]  # fmt: skip
    torch.testing.assert_close(batch, twin_batch, rtol=0, atol=0)


def _pair_run(intervals, which):
    """Models A and B, KFLR (exact: no sampling) every ``intervals[i]`` steps, each model on
    its own batches; ``which``: the models trained in this run. Returns the parameters, and
    per step whether each model's hooks were on."""
    models = {}
    for i, name in enumerate("AB"):
        if name in which:
            model = curvopt.extend(_model(seed=i))
            opt = KFAC(model.parameters(), lr=0.1, damping=0.1, curvature="kflr",
                       curvature_interval=intervals[i])  # fmt: skip
            models[name] = (model, opt)
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    hooked = []
    for step in range(9):
        for _, opt in models.values():
            opt.zero_grad()
        hooked.append({name: _ours(model[0]) for name, (model, _) in models.items()})
        for name, (model, _) in models.items():
            X, y = _batch(step + 50 * (name == "B"))
            lossfunc(model(X), y).backward()
        for _, opt in models.values():
            opt.step()
    params = {name: [p.detach().clone() for p in m.parameters()] for name, (m, _) in models.items()}
    return params, hooked


def test_two_optimizers_on_two_models_rest_by_their_own_schedules():
    together, hooked = _pair_run((3, 4), "AB")
    for step, on in enumerate(hooked):
        assert on == {"A": int(step % 3 == 0), "B": int(step % 4 == 0)}, step
    for name in "AB":
        gc.collect()
        alone, _ = _pair_run((3, 4), name)
        for p, q in zip(together[name], alone[name]):
            torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_a_generator_refreshes_through_a_resting_discriminator():
    """A GAN's generator step backpropagates through the discriminator, whose optimizer rests:
    its hooks stay off (but in the generator's optimizer's first window, before which it knows
    no model of its own), and the generator's steps equal those through a discriminator whose
    hooks record (no optimizer of its own)."""
    runs = []
    for rests in (True, False):
        gc.collect()
        torch.manual_seed(0)
        G = curvopt.extend(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 5)).to(DT))
        D = curvopt.extend(nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2)).to(DT))
        lossfunc = curvopt.extend(nn.CrossEntropyLoss())
        opt_d = KFAC(D.parameters(), lr=0.0, curvature="kflr", curvature_interval=10)
        X, y = _batch(0)
        opt_d.zero_grad()
        lossfunc(D(G(X[:, :3]).detach()), y % 2).backward()
        opt_d.step()  # a refresh: D's next nine steps are plain ones
        if not rests:
            del opt_d
            gc.collect()
        opt_g = KFAC(G.parameters(), lr=0.1, damping=0.1, curvature="kflr", curvature_interval=2)
        for step in range(1, 6):
            opt_g.zero_grad()
            assert _ours(D[0]) == (step == 1 or not rests), step
            X, y = _batch(step)
            lossfunc(D(G(X[:, :3])), y % 2).backward()
            opt_g.step()
        runs.append([p.detach().clone() for p in G.parameters()])
        assert hasattr(G[0].weight, "kflr")
    for p, q in zip(*runs):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def _resting_model(interval=5):
    model, lossfunc = curvopt.extend(_model()), curvopt.extend(nn.CrossEntropyLoss())
    opt = KFAC(model.parameters(), lr=0.1, damping=0.1, curvature_interval=interval)
    _train(model, lossfunc, opt, 0)
    assert _hooked(model) == _resting(model)
    return model, lossfunc, opt


def test_unextend_while_resting_brings_no_hook_back():
    model, lossfunc, opt = _resting_model(interval=2)
    curvopt.unextend(model)
    _train(model, lossfunc, opt, 1)  # its refresh window starts
    assert _hooked(model) == [0] * 4 + [False] * 4
    assert all(p._backward_hooks is None for p in model.parameters())
    assert not is_extended(model) and not is_extended(model[0].weight)
    curvopt.extend(model)  # hooked anew, once
    assert _hooked(model) == _awake(model)


def test_extend_again_while_resting_hooks_once():
    model, lossfunc, opt = _resting_model(interval=2)
    assert curvopt.extend(model) is model
    assert _hooked(model) == _resting(model)
    _train(model, lossfunc, opt, 1)
    assert _hooked(model) == _awake(model)
    assert [len(m._forward_hooks) for m in model.modules()] == [1, 1, 0, 1]


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_of_a_resting_model_is_a_plain_model(how):
    model, lossfunc, opt = _resting_model()
    if how == "deepcopy":
        twin = copy.deepcopy(model)
    else:
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        twin = torch.load(buffer, weights_only=False)
    assert [len(m._forward_hooks) for m in twin.modules()] == [0] * 4
    assert not any(p._backward_hooks for p in twin.parameters())
    assert not is_extended(twin[0])
    del opt
    gc.collect()  # the original's hooks come back; the copy's stay away
    assert _hooked(model) == _awake(model) and not any(_hooked(twin))
    curvopt.extend(twin)
    assert _hooked(twin) == _awake(twin)
    pickle.loads(pickle.dumps(_model()))  # (a plain model pickles: the case above is fair)


def test_a_module_shared_by_two_models_rests_while_both_rest():
    """``shared`` in models A and B, each with an optimizer of its own: its hooks are on while
    either optimizer's refresh window runs, its weight's tensor hook too. A's optimizer, whose
    parameters B holds too, covers B: B's own layer is on in its windows as well; B's does
    not cover A."""
    torch.manual_seed(0)
    shared = nn.Linear(5, 5).to(DT)
    A = curvopt.extend(nn.Sequential(shared, nn.Tanh(), nn.Linear(5, 3)).to(DT))
    B = curvopt.extend(nn.Sequential(shared, nn.Sigmoid(), nn.Linear(5, 3)).to(DT))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    opt_a = KFAC(A.parameters(), lr=0.1, damping=0.1, curvature="kflr", curvature_interval=2)
    opt_b = KFAC(B[2].parameters(), lr=0.1, damping=0.1, curvature="kflr", curvature_interval=3)
    for step in range(7):
        opt_a.zero_grad()
        opt_b.zero_grad()
        a, b = step % 2 == 0, step % 3 == 0
        assert (_ours(A[2]), _ours(B[2]), _ours(shared)) == (a, a or b, a or b), step
        assert (shared.weight._backward_hooks is not None) == (a or b), step
        X, y = _batch(step)
        (lossfunc(A(X), y) + lossfunc(B(X), y)).backward()
        opt_a.step()
        opt_b.step()
    assert hasattr(shared.weight, "kflr")


def test_tied_weights_rest_and_wake_with_their_modules():
    torch.manual_seed(0)
    embed = nn.Embedding(7, 4).to(DT)
    head = nn.Linear(4, 7, bias=False).to(DT)
    head.weight = embed.weight
    model = curvopt.extend(nn.Sequential(embed, nn.Tanh(), head))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    opt = KFAC(model.parameters(), lr=0.1, damping=0.1, curvature_interval=2, fallback="diagonal")
    generator = torch.Generator().manual_seed(0)
    for step in range(4):
        opt.zero_grad()
        assert (embed.weight._backward_hooks is not None) == (step % 2 == 0)
        assert _ours(embed) == _ours(head) == (step % 2 == 0)
        X = torch.randint(0, 7, (6,), generator=generator)
        lossfunc(model(X), X).backward()
        opt.step()


def test_a_parameter_unfrozen_while_resting_is_hooked_when_woken():
    """LoRA-style: a weight frozen at ``extend``, outside the optimizer, unfrozen while the
    model rests, gets its tensor hook at the first forward of a woken model
    (``ModuleEntry.unhooked``), and its per-sample gradients then."""
    model = _model()
    model[0].weight.requires_grad_(False)
    curvopt.extend(model)
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    opt = KFAC(model[2].parameters(), lr=0.1, damping=0.1, curvature_interval=3)
    _train(model, lossfunc, opt, 0)
    model[0].weight.requires_grad_(True)
    _train(model, lossfunc, opt, 1)  # plain: no hook
    assert model[0].weight._backward_hooks is None and _ours(model[0]) == 0
    with curvopt.collect(curvopt.extensions.BatchGrad()):
        X, y = _batch(2)
        model.zero_grad()
        lossfunc(model(X), y).backward()
        assert len(model[0].weight._backward_hooks) == 1
    torch.testing.assert_close(model[0].weight.grad_batch.sum(0), model[0].weight.grad)
    assert model[0].weight._backward_hooks is None  # resting again: its new hook too


def test_an_optimizer_freed_while_resting_gives_the_hooks_back():
    """The weakref callback of the freed optimizer's collection puts the hooks back: a forward
    before a ``collect`` block around its backward (as documented) records again."""
    model, lossfunc, opt = _resting_model()
    del opt
    gc.collect()
    assert _hooked(model) == _awake(model) and not STATE.taken
    X, y = _batch(1)
    loss = nn.functional.cross_entropy(model(X), y, reduction="sum")
    model.zero_grad()
    with curvopt.collect(curvopt.extensions.BatchGrad()):
        loss.backward()
    torch.testing.assert_close(model[2].weight.grad_batch.sum(0), model[2].weight.grad)


def test_a_collect_block_wakes_every_resting_model():
    model, lossfunc, opt = _resting_model()
    with curvopt.collect(curvopt.extensions.BatchGrad()):
        assert _hooked(model) == _awake(model) and _ours(lossfunc) == 1
    assert _hooked(model) == _resting(model) and _ours(lossfunc) == 0


def test_a_compiled_model_rests_too():
    """``extend(torch.compile(model))``: the compiled wrapper's modules lose their hooks on the
    plain steps (which run compiled), get them back for a refresh (run eagerly)."""
    torch._dynamo.reset()
    model = curvopt.extend(torch.compile(_model()))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    opt = KFAC(model.parameters(), lr=0.1, damping=0.1, curvature="kflr", curvature_interval=2)
    inner = model._orig_mod
    for step in range(4):
        opt.zero_grad()
        assert _ours(inner[0]) == _ours(model) == (step % 2 == 0), step
        X, y = _batch(step)
        lossfunc(model(X), y).backward()
        opt.step()
    assert hasattr(inner[0].weight, "kflr")


class _Checkpointed(nn.Module):
    """``_model``'s layers, the last through ``torch.utils.checkpoint`` (``reentrant``: re-run
    inside the backward's own autograd task) or not (``None``)."""

    def __init__(self, reentrant):
        super().__init__()
        self.body, self.head = nn.Sequential(*_model()[:2]), _model()[2]
        self.reentrant = reentrant

    def forward(self, x):
        if self.reentrant is None:
            return self.head(self.body(x))
        checkpoint = torch.utils.checkpoint.checkpoint
        return checkpoint(self.head, self.body(x), use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_checkpointed_model_rests_and_refreshes_as_the_plain_one(reentrant):
    """Gradient checkpointing re-runs the forward in the backward: with hooks on at the
    refreshes and off between, the steps equal those of the model without checkpoints."""
    runs = []
    for how in (reentrant, None):
        gc.collect()
        model = curvopt.extend(_Checkpointed(how))
        lossfunc = curvopt.extend(nn.CrossEntropyLoss())
        opt = KFAC(model.parameters(), lr=0.1, damping=0.1, curvature="kflr", curvature_interval=2)
        for step in range(5):
            opt.zero_grad()
            assert _ours(model.head) == (step % 2 == 0), step
            _train(model, lossfunc, opt, step)
        runs.append([p.detach().clone() for p in model.parameters()])
    for p, q in zip(*runs):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)


def test_parameters_of_a_resting_model_added_to_an_awake_optimizer_wake_it():
    """``add_param_group`` with parameters of model B, whose own optimizer rests, to A's
    optimizer, which collects every step: B's hooks are back before the next forward (A's
    collection covers every model until its next pass names its parameters, then A's and B's),
    and A's step preconditions B's layer with its curvature."""
    A, B = curvopt.extend(_model(seed=0)), curvopt.extend(_model(seed=1))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    opt_a = KFAC(A.parameters(), lr=0.1, damping=0.1, curvature="kflr", curvature_interval=1)
    opt_b = KFAC(B[0].parameters(), lr=0.1, damping=0.1, curvature="kflr", curvature_interval=9)
    for step in range(4):
        if step == 2:
            opt_a.add_param_group({"params": list(B[2].parameters())})
        opt_a.zero_grad()
        opt_b.zero_grad()
        assert (_ours(A[0]), _ours(B[0]), _ours(B[2])) == (1, *[int(step in (0, 2, 3))] * 2)
        X, y = _batch(step)
        lossfunc(A(X), y).backward()
        lossfunc(B(X), y).backward()
        opt_a.step()
        opt_b.step()
    assert hasattr(B[2].weight, "kflr")  # in no optimizer but A's


def _python_calls(model, lossfunc, X, y) -> int:
    """The Python function calls of one forward and backward (on the CPU the backward runs in
    this thread, its tensor hooks too)."""
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        calls += event == "call"

    model.zero_grad()
    sys.setprofile(count)
    try:
        lossfunc(model(X), y).backward()
    finally:
        sys.setprofile(None)
    return calls


def test_a_resting_model_makes_the_python_calls_of_the_plain_model():
    """The cost of issue 65, counted rather than timed: forward and backward of a resting
    model make as many Python calls as the plain model's (torch's fast path for a module
    without hooks, no tensor hook into Python), and more once woken."""
    plain = _model()
    model, lossfunc = curvopt.extend(copy.deepcopy(plain)), curvopt.extend(nn.CrossEntropyLoss())
    opt = KFAC(model.parameters(), lr=0.0, curvature_interval=2)
    _train(model, lossfunc, opt, 0)
    X, y = _batch(1)
    for _ in range(2):  # (the first call of each warms caches up)
        counts = [_python_calls(m, f, X, y) for m, f in ((plain, nn.CrossEntropyLoss()),
                                                        (model, lossfunc))]  # fmt: skip
    assert counts[1] == counts[0], counts
    opt.step()  # its refresh window: the hooks back
    assert _python_calls(model, lossfunc, X, y) > counts[0]
