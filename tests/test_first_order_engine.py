"""Engine behaviour of ``extend``/``collect`` for first-order quantities: nothing happens outside
``collect``, no state accumulates, failures write nothing half-way, argument errors, and results
a user kept are never overwritten by buffer reuse."""

import copy
import gc
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    DT,
    FIRST_ORDER,
    assert_close,
    assert_first_order,
    clear_attributes,
    extended_copy,
    per_sample_grads_loop,
    run_collect,
)
from torch import nn

import curvopt
from curvopt import extensions as ext
from curvopt.core.extended import is_extended, live_calls, module_path
from curvopt.errors import ExtensionConflictError, GraphReuseError, UnsupportedModuleError
from curvopt.extensions.base import Extension
from curvopt.layers import conv, embedding, generic, linear, norm

ATTRS = tuple(FIRST_ORDER)
ALL = lambda: [cls() for cls in FIRST_ORDER.values()]  # noqa: E731


class Mixed(nn.Module):
    """One module of every rule family, a module called twice and a tied weight."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(6, 4)
        self.conv = nn.Conv1d(4, 4, 3, padding=1)
        self.norm = nn.LayerNorm(4)
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        self.fc = nn.Linear(4, 4)
        self.out = nn.Linear(4, 6)
        self.out.weight = self.emb.weight

    def forward(self, idx):
        h = self.emb(idx)
        h = self.conv(h.transpose(1, 2)).transpose(1, 2)
        h = self.norm(h)
        h = h + self.attn(h, h, h)[0]
        h = self.fc(torch.tanh(self.fc(h)))
        return self.out(h).mean(1)


def _data(n=3, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 6, (n, 5), generator=gen), torch.randint(0, 6, (n,), generator=gen)


def _modules_with_records(model):
    return [m for m in model.modules() if is_extended(m)]


def _live(model):
    return {module_path(m): live_calls(m) for m in _modules_with_records(model)}


def _record_objects(model):
    """The records of ``model``'s calls still holding their inputs (released ones hold no
    tensors); records of other tests' models are not counted: pytest keeps the traceback of a
    test's last exception (``sys.last_traceback``, an expected failure's too), and with it
    that test's graph and records."""
    from curvopt.frontend.hooks import Record

    gc.collect()
    modules = set(model.modules())
    return sum(
        isinstance(o, Record) and o.args is not None and o.module in modules
        for o in gc.get_objects()
    )


# ------------------------------------------------------------------------------ outside collect


@pytest.fixture
def no_rule_work(monkeypatch):
    """Every rule computation raises: outside ``collect`` none may run."""
    gc.collect()  # optimizers of earlier tests, armed, would wake every extended model's hooks

    def forbidden(*args, **kwargs):
        raise AssertionError("per-sample work outside collect")

    for module in (linear, conv, embedding, norm, generic):
        for obj in vars(module).values():
            if isinstance(obj, type) and issubclass(obj, curvopt.layers.LayerRule):
                for name in (
                    "batch_grad",
                    "batch_l2",
                    "sum_grad_squared",
                    "grad_sum",
                    "batch_grads",
                ):
                    if name in vars(obj):
                        monkeypatch.setattr(obj, name, forbidden)


def test_nothing_outside_collect(no_rule_work, seed):
    plain = Mixed().to(DT)
    model = extended_copy(plain)
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    idx, y = _data()
    out = model(idx)
    assert torch.equal(out, plain(idx))
    lossfunc(out, y).backward()
    nn.CrossEntropyLoss()(plain(idx), y).backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad), name
        assert not any(hasattr(p, a) for a in ATTRS), name
    assert set(_live(model).values()) == {0}


def test_extended_outputs_equal_plain(seed):
    plain = Mixed().to(DT)
    model = extended_copy(plain)
    idx, y = _data()
    expected = plain(idx)
    assert torch.equal(model(idx), expected)
    with curvopt.collect(*ALL()):
        out = model(idx)
        assert torch.equal(out, expected)
        F.cross_entropy(out, y).backward()
    with torch.no_grad():
        assert torch.equal(model(idx), expected)


def test_extend_twice_is_harmless(seed):
    plain = Mixed().to(DT)
    model = extended_copy(plain)
    hooks = {name: len(m._forward_hooks) for name, m in model.named_modules()}
    assert curvopt.extend(model) is model
    assert curvopt.extend(model.fc) is model.fc
    assert {name: len(m._forward_hooks) for name, m in model.named_modules()} == hooks
    idx, y = _data()
    reference = per_sample_grads_loop(plain, nn.CrossEntropyLoss(), idx, y)
    run_collect(model, nn.CrossEntropyLoss(), idx, y)
    assert_first_order(model, reference)


def test_no_grad_forward_does_nothing(seed):
    model = extended_copy(Mixed().to(DT))
    idx, _ = _data()
    with curvopt.collect(*ALL()):
        with torch.no_grad():
            out = model(idx)
        assert not out.requires_grad
        assert set(_live(model).values()) == {0}
    assert _record_objects(model) == 0
    assert not any(hasattr(p, a) for p in model.parameters() for a in ATTRS)


def test_backward_outside_then_inside_collect(seed):
    plain = Mixed().to(DT)
    model = extended_copy(plain)
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    idx, y = _data()
    lossfunc(model(idx), y).backward()
    assert not any(hasattr(p, a) for p in model.parameters() for a in ATTRS)
    idx2, y2 = _data(seed=2)
    reference = per_sample_grads_loop(plain, nn.CrossEntropyLoss(), idx2, y2)
    run_collect(model, lossfunc, idx2, y2)
    assert_first_order(model, reference)
    # and once more outside: the attributes of the collected pass stay as they were
    kept = {k: p.grad_batch.clone() for k, p in model.named_parameters()}
    lossfunc(model(idx), y).backward()
    for k, p in model.named_parameters():
        assert torch.equal(p.grad_batch, kept[k])


def test_forward_inside_collect_backward_outside(seed):
    """The pass that counts is the backward: a backward after the block writes nothing."""
    model = extended_copy(Mixed().to(DT))
    idx, y = _data()
    with curvopt.collect(*ALL()):
        loss = F.cross_entropy(model(idx), y)
    loss.backward()
    assert not any(hasattr(p, a) for p in model.parameters() for a in ATTRS)


def test_plain_loss_function(seed):
    """First-order quantities do not need an extended loss module."""
    plain = Mixed().to(DT)
    model = extended_copy(plain)
    idx, y = _data()
    reference = per_sample_grads_loop(
        plain, lambda o, t: F.cross_entropy(o, t, reduction="sum"), idx, y
    )
    run_collect(model, lambda o, t: F.cross_entropy(o, t, reduction="sum"), idx, y)
    assert_first_order(model, reference)


# ------------------------------------------------------------------------------ no growth


@pytest.mark.parametrize("attrs", [ATTRS, ("batch_l2", "variance")])
def test_no_state_growth_over_steps(attrs, seed):
    model = extended_copy(Mixed().to(DT))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    counts = []

    def sizes():
        return {
            (k, n): len(v)
            for k, m in model.named_modules()
            for n, v in vars(m).items()
            if n.startswith("_curvopt") and isinstance(v, (list, dict, set, tuple))
        }

    initial = sizes()
    for step in range(20):
        idx, y = _data(seed=step)
        opt.zero_grad()
        loss = lossfunc(model(idx), y)
        with curvopt.collect(*(FIRST_ORDER[a]() for a in attrs)):
            loss.backward()
        opt.step()
        del loss
        # released by reference counting alone, without waiting for the cycle collector
        assert set(_live(model).values()) == {0}, f"step {step}: {_live(model)}"
        assert sizes() == initial  # nothing accumulates on modules
        if step in (2, 19):
            gc.collect()
            counts.append(sum(isinstance(o, torch.Tensor) for o in gc.get_objects()))
    assert _record_objects(model) == 0
    assert counts[1] <= counts[0], counts


def test_forward_without_backward_releases_records(seed):
    model = extended_copy(Mixed().to(DT))
    idx, _ = _data()
    for _ in range(5):
        out = model(idx)
        assert max(_live(model).values()) >= 1
        del out
    gc.collect()
    assert set(_live(model).values()) == {0}
    assert _record_objects(model) == 0


# ------------------------------------------------------------------------------ failures


def _bn_before_linear():
    model = nn.Sequential(
        OrderedDict(
            fc0=nn.Linear(3, 4),
            block=nn.Sequential(OrderedDict(bn=nn.BatchNorm1d(4))),
            fc1=nn.Linear(4, 3),
        )
    ).to(DT)
    with torch.no_grad():
        model.block.bn.running_var.fill_(2.0)
    return model.eval()


@pytest.mark.parametrize("kept", ["none", "clone"])
def test_failure_mid_pass_leaves_no_half_written_attribute(kept, seed):
    """Pass 2 fails at the BatchNorm (train mode) after ``fc1`` was processed: every attribute is
    either absent or exactly what pass 1 wrote."""
    model = curvopt.extend(_bn_before_linear())
    x, y = torch.randn(3, 3, dtype=DT), torch.randn(3, 3, dtype=DT)
    run_collect(model, nn.MSELoss(), x, y)
    before = {(k, a): getattr(p, a).clone() for k, p in model.named_parameters() for a in ATTRS}
    model.block.bn.train()
    loss = F.mse_loss(model(2 * x + 1), y)
    with pytest.raises(UnsupportedModuleError, match="block.bn"):
        with curvopt.collect(*ALL()):
            loss.backward()
    for k, p in model.named_parameters():
        for a in ATTRS:
            if hasattr(p, a):
                assert torch.equal(getattr(p, a), before[(k, a)]), f"{k}.{a} half-written"


def test_user_hook_failure_mid_pass_leaves_no_half_written_attribute(seed):
    """An exception from a user's tensor hook after ``fc1``'s per-sample gradients were computed
    (into the reused buffer of pass 1) must not leave pass-2 numbers on ``fc1``."""
    model = curvopt.extend(_bn_before_linear())
    x, y = torch.randn(3, 3, dtype=DT), torch.randn(3, 3, dtype=DT)
    run_collect(model, nn.MSELoss(), x, y, ("grad_batch",))
    before = {k: p.grad_batch.clone() for k, p in model.named_parameters()}

    h = model.block(model.fc0(2 * x + 1))

    def boom(grad):
        raise ValueError("user hook failed")

    h.register_hook(boom)  # fires after fc1's hook, before bn's and fc0's
    loss = F.mse_loss(model.fc1(h), y)
    with pytest.raises(ValueError, match="user hook failed"):
        with curvopt.collect(ext.BatchGrad()):
            loss.backward()
    for k, p in model.named_parameters():
        if hasattr(p, "grad_batch"):
            assert torch.equal(p.grad_batch, before[k]), f"{k}.grad_batch half-written"


def test_collect_usable_after_failure(seed):
    plain = _bn_before_linear()
    model = curvopt.extend(copy.deepcopy(plain))
    x, y = torch.randn(3, 3, dtype=DT), torch.randn(3, 3, dtype=DT)
    model.block.bn.train()
    loss = F.mse_loss(model(x), y)
    with pytest.raises(UnsupportedModuleError):
        with curvopt.collect(*ALL()):
            loss.backward()
    del loss
    model.block.bn.eval()
    model.block.bn.load_state_dict(plain.block.bn.state_dict())  # undo the train-mode forward
    reference = per_sample_grads_loop(plain, nn.MSELoss(), x, y)
    run_collect(model, nn.MSELoss(), x, y)
    assert_first_order(model, reference)
    gc.collect()
    assert set(_live(model).values()) == {0}


# ------------------------------------------------------------------------------ arguments


def test_nested_collect_is_an_error():
    with curvopt.collect(ext.BatchGrad()):
        with pytest.raises(RuntimeError, match="nested"):
            with curvopt.collect(ext.Variance()):
                pass
    with curvopt.collect(ext.BatchGrad()):  # the outer block was left in a clean state
        pass


def test_conflicting_extensions():
    class OtherL2(Extension):
        quantity = ext.BatchL2Grad.quantity  # another class declaring the same attribute

    with pytest.raises(ExtensionConflictError, match="batch_l2"):
        curvopt.collect(ext.BatchL2Grad(), OtherL2())
    with pytest.raises(ExtensionConflictError):
        curvopt.collect(ext.BatchGrad(), ext.BatchGrad(chunk=2))
    curvopt.collect(ext.BatchGrad(), ext.BatchGrad())  # identical duplicates are fine
    if hasattr(ext, "DiagGGNMC"):
        with pytest.raises(ExtensionConflictError, match="diag_ggn_mc"):
            curvopt.collect(ext.DiagGGNMC(mc_samples=1), ext.DiagGGNMC(mc_samples=2))


@pytest.mark.parametrize("bad", [ext.BatchGrad, "BatchGrad", None, 3, nn.Linear(1, 1)])
def test_non_extension_arguments(bad):
    with pytest.raises(TypeError, match="extension"):
        curvopt.collect(ext.Variance(), bad)


def test_extend_non_module():
    with pytest.raises(TypeError):
        curvopt.extend(lambda x: x)


# ------------------------------------------------------------------------------ buffer reuse


def _two_passes(keep):
    """Pass 1, keep something of ``grad_batch`` via ``keep``, pass 2 with other data; returns
    (model, kept, snapshot of pass 1, reference of pass 2)."""
    plain = Mixed().to(DT)
    model = extended_copy(plain)
    idx1, y1 = _data(seed=1)
    idx2, y2 = _data(seed=2)
    run_collect(model, nn.CrossEntropyLoss(), idx1, y1, ("grad_batch",))
    snapshot = {k: p.grad_batch.clone() for k, p in model.named_parameters()}
    kept = {k: keep(p) for k, p in model.named_parameters()}
    reference = per_sample_grads_loop(plain, nn.CrossEntropyLoss(), idx2, y2)
    run_collect(model, nn.CrossEntropyLoss(), idx2, y2, ("grad_batch",), clear=False)
    assert_first_order(model, reference, ("grad_batch",))
    return model, kept, snapshot


KEEPERS = {
    "reference": lambda p: p.grad_batch,
    "view": lambda p: p.grad_batch[1:],
    "flat-view": lambda p: p.grad_batch.view(-1),
    "in-list": lambda p: [p.grad_batch],
    "numpy": lambda p: p.grad_batch.numpy(),
    "storage": lambda p: p.grad_batch.untyped_storage(),
}


@pytest.mark.parametrize("how", list(KEEPERS))
def test_kept_results_are_not_overwritten(how, seed):
    model, kept, snapshot = _two_passes(KEEPERS[how])
    for k, p in model.named_parameters():
        value = kept[k]
        if how == "reference":
            assert torch.equal(value, snapshot[k]) and value is not p.grad_batch
        elif how in ("view",):
            assert torch.equal(value, snapshot[k][1:])
        elif how == "flat-view":
            assert torch.equal(value, snapshot[k].view(-1))
        elif how == "in-list":
            assert torch.equal(value[0], snapshot[k])
        elif how == "numpy":
            assert torch.equal(torch.from_numpy(value), snapshot[k])
        elif how == "storage":
            t = torch.empty(0, dtype=DT).set_(value, 0, snapshot[k].shape)
            assert torch.equal(t, snapshot[k])


def test_results_alias_nothing_else(seed):
    """Results of one pass never share memory with each other or with ``p.grad``."""
    model = extended_copy(Mixed().to(DT))
    idx, y = _data()
    run_collect(model, nn.CrossEntropyLoss(), idx, y)
    run_collect(model, nn.CrossEntropyLoss(), idx, y, clear=False)  # buffers may be reused
    ptrs = {}
    for k, p in model.named_parameters():
        for a in ATTRS + ("grad",):
            t = getattr(p, a)
            ptr = t.untyped_storage().data_ptr()
            assert ptr not in ptrs, f"{k}.{a} shares memory with {ptrs[ptr]}"
            ptrs[ptr] = f"{k}.{a}"


def test_changing_batch_size_between_passes(seed):
    plain = Mixed().to(DT)
    model = extended_copy(plain)
    for n in (3, 5, 1, 3):
        idx, y = _data(n=n, seed=n)
        reference = per_sample_grads_loop(plain, nn.CrossEntropyLoss(), idx, y)
        run_collect(model, nn.CrossEntropyLoss(), idx, y, clear=False)
        assert_first_order(model, reference)


def test_clear_attributes_helper():
    """The helper the other tests rely on removes every first-order attribute."""
    model = extended_copy(nn.Linear(2, 2).to(DT))
    run_collect(model, nn.MSELoss(), torch.randn(2, 2, dtype=DT), torch.randn(2, 2, dtype=DT))
    clear_attributes(model)
    assert not any(hasattr(p, a) for p in model.parameters() for a in ATTRS)
    assert_close(torch.ones(2), torch.ones(2))


# ------------------------------------------------------------------- tied and reused parameters
# Each test asserts the one documented behaviour: the right numbers, or the specific error with
# nothing written.


class _FunctionalTie(nn.Module):
    """GPT-style output layer: the embedding matrix used functionally by the parent module."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(6, 4)
        self.fc = nn.Linear(4, 4)

    def forward(self, idx):
        h = torch.tanh(self.fc(self.wte(idx)))
        return (h @ self.wte.weight.T).mean(1)


@pytest.mark.parametrize("attrs", [("grad_batch",), ("batch_l2",)])
def test_parameter_used_outside_its_module(attrs, seed):
    """README: a parameter used outside its module is caught by the gradient-sum check and
    raises ``UnsupportedModuleError`` explaining the tied-output pattern; nothing is written."""
    plain = _FunctionalTie().to(DT)
    model = extended_copy(plain)
    idx, y = _data()
    with pytest.raises(UnsupportedModuleError, match="outside the module that owns it"):
        run_collect(model, nn.CrossEntropyLoss(), idx, y, attrs)
    for p in model.parameters():
        assert not any(hasattr(p, a) for a in ATTRS)


class _TwoLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("attrs", [("batch_l2",), ("sum_grad_squared", "variance")])
def test_tied_weight_in_separately_extended_submodules(attrs, seed):
    """A weight tied across two modules, each extended on its own: exact (sums over the uses)."""
    plain = _TwoLinear().to(DT)
    model = copy.deepcopy(plain)
    curvopt.extend(model.a)
    curvopt.extend(model.b)
    x, y = torch.randn(3, 4, dtype=DT), torch.randn(3, 4, dtype=DT)
    reference = per_sample_grads_loop(plain, nn.MSELoss(), x, y)
    run_collect(model, nn.MSELoss(), x, y, attrs)
    assert_first_order(model, reference, attrs)


def test_parameter_replaced_after_extend(seed):
    """Tying after ``extend`` (the hooks are on the modules, not the parameters): exact."""
    plain = _TwoLinear().to(DT)
    model = copy.deepcopy(plain)
    model.b.weight = nn.Parameter(model.b.weight.detach().clone())
    curvopt.extend(model)
    model.b.weight = model.a.weight  # tie after extend
    x, y = torch.randn(3, 4, dtype=DT), torch.randn(3, 4, dtype=DT)
    reference = per_sample_grads_loop(plain, nn.MSELoss(), x, y)
    run_collect(model, nn.MSELoss(), x, y, ("grad_batch",))
    assert_first_order(model, reference, ("grad_batch",))


def test_second_backward_through_retained_graph(seed):
    """README: a second backward pass through the same graph inside ``collect`` raises
    ``GraphReuseError`` (the module inputs were released after the first)."""
    model = extended_copy(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(DT))
    out = model(torch.randn(3, 3, dtype=DT))
    with pytest.raises(GraphReuseError, match="second backward pass"):
        with curvopt.collect(ext.BatchGrad()):
            out.pow(2).sum().backward(retain_graph=True)
            model.zero_grad()
            out.sum().backward()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_single_sample(reduction, seed):
    """N = 1 through every rule family (embedding, conv, norm, attention, linear, tied)."""
    plain = Mixed().to(DT)
    idx, y = _data(n=1)
    reference = per_sample_grads_loop(plain, nn.CrossEntropyLoss(reduction=reduction), idx, y)
    model = extended_copy(plain)
    for attrs in (ATTRS, ("batch_l2", "sum_grad_squared", "variance")):
        run_collect(model, nn.CrossEntropyLoss(reduction=reduction), idx, y, attrs)
        assert_first_order(model, reference, attrs)
        if "variance" in attrs:
            for p in model.parameters():
                assert p.variance.abs().max() < 1e-12  # one sample: no variance
