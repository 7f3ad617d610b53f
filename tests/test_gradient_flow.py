"""The per-pass check that gradient enters the graph upstream of the extended losses only
through them (``flow.FlowCheck``): hooks on the graph's nodes, no propagated column.

Each case runs several passes of one graph structure: a term of the objective whose weight is 0
gives the reference (float64, torch.func), the same term with a non-zero weight on a later pass
raises and writes nothing, wherever it enters (a module's output, an intermediate result with
one consumer or several, a parameter); the error names where (also for a module that no
extended loss reaches).
"""

import copy

import pytest
import torch
from conftest import ALL_ATTRS, DT, assert_close, assert_no_attributes, clear_attributes
from conftest import ggn_reference
from torch import nn

import curvopt
from curvopt import extensions as ext
from curvopt.errors import UnsupportedModuleError
from curvopt.core.plans import plan_cache

N = 6
CE = nn.CrossEntropyLoss()


class _Net(nn.Module):
    """``b(h) (+ h @ P for the residual)``, ``h = tanh(a(x))``; ``aux`` reads ``h`` and feeds
    no loss."""

    def __init__(self, residual):
        super().__init__()
        self.a, self.b, self.aux = nn.Linear(4, 5), nn.Linear(5, 3), nn.Linear(5, 2)
        self.residual = residual
        self.hidden = None

    def forward(self, x):
        h = torch.tanh(self.a(x))
        self.hidden = h
        out = self.b(h)
        if self.residual:
            out = out + h[:, :3]
        return out


def _case(residual, seed=0):
    torch.manual_seed(seed)
    plain = _Net(residual).to(DT)
    x, y = torch.randn(N, 4, dtype=DT), torch.randint(0, 3, (N,))
    return plain, curvopt.extend(copy.deepcopy(plain)), curvopt.extend(nn.CrossEntropyLoss()), x, y


def _term(model, out, where):
    if where == "hidden":
        return (model.hidden**2).sum()
    if where == "output":
        return out.logsumexp(1).pow(2).mean()  # a z-loss
    if where == "parameter":
        return (model.a.weight**2).sum()
    return model.aux(model.hidden).pow(2).sum()  # "unreached": a module no loss depends on


def _reference(plain, x, y):
    blocks, _ = ggn_reference(nn.Sequential(plain), CE, x, y)
    return {k[2:]: torch.diagonal(v) for k, v in blocks.items()}


@pytest.mark.parametrize("residual", [False, True], ids=["chain", "residual"])
@pytest.mark.parametrize("where", ["hidden", "output", "parameter"])
@pytest.mark.parametrize("extension", [ext.DiagGGNExact, ext.KFAC, ext.DiagHessian])
def test_term_outside_the_losses_passes_at_weight_zero_and_raises_later(residual, where, extension):
    plain, model, lossfunc, x, y = _case(residual)
    want = _reference(plain, x, y) if extension is ext.DiagGGNExact else None
    for lam in (0.0, 0.0, 0.3):
        clear_attributes(model, ALL_ATTRS)
        out = model(x)
        term = _term(model, out, where)  # before the loss: the loss's hook runs first
        loss = lossfunc(out, y) + lam * term
        if lam == 0.0:
            with curvopt.collect(extension()):
                loss.backward()
            attr = extension().attr
            assert attr in model.a.weight.__dict__
            if want is not None:
                for name, p in model.named_parameters():
                    if not name.startswith("aux"):
                        assert_close(getattr(p, attr).flatten(), want[name], name)
            continue
        with pytest.raises(UnsupportedModuleError, match="alone|outside the module"):
            with curvopt.collect(extension()):
                loss.backward()
        assert_no_attributes(model)


@pytest.mark.parametrize("residual", [False, True], ids=["chain", "residual"])
def test_flow_check_names_where_the_term_enters(residual):
    _, model, lossfunc, x, y = _case(residual)
    for where, match in [
        ("hidden", "intermediate result .*TanhBackward0"),
        ("parameter", "'a.weight' receives gradient from outside"),
        ("unreached", "module 'aux'"),
    ]:
        out = model(x)
        term = _term(model, out, where)
        with pytest.raises(UnsupportedModuleError, match=match):
            with curvopt.collect(ext.DiagGGNExact()):
                (lossfunc(out, y) + 0.5 * term).backward()


class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk, self.cls, self.reg = nn.Linear(4, 5), nn.Linear(5, 3), nn.Linear(5, 2)

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        return self.cls(h), self.reg(h)


def test_two_extended_losses_on_a_shared_trunk_are_not_foreign_to_each_other():
    """The trunk's output has one consumer in each loss's graph; both are counted."""
    torch.manual_seed(0)
    plain = _TwoHeads().to(DT)
    model = curvopt.extend(copy.deepcopy(plain))
    ce, mse = curvopt.extend(nn.CrossEntropyLoss()), curvopt.extend(nn.MSELoss())
    x, y, t = torch.randn(N, 4, dtype=DT), torch.randint(0, 3, (N,)), torch.randn(N, 2, dtype=DT)
    for _ in range(2):
        clear_attributes(model, ALL_ATTRS)
        a, b = model(x)
        with curvopt.collect(ext.DiagGGNExact()):
            (ce(a, y) + 0.5 * mse(b, t)).backward()
    ga, _ = ggn_reference(nn.Sequential(_Head(plain, 0)), CE, x, y)
    gb, _ = ggn_reference(nn.Sequential(_Head(plain, 1)), nn.MSELoss(), x, t)
    for name, p in model.named_parameters():
        key = f"0.net.{name}"
        want = torch.diagonal(ga[key]) + 0.5 * torch.diagonal(gb[key])
        assert_close(p.diag_ggn_exact.flatten(), want, name)


class _Head(nn.Module):
    def __init__(self, net, index):
        super().__init__()
        self.net, self.index = net, index

    def forward(self, x):
        return self.net(x)[self.index]


def test_target_that_depends_on_the_model_raises():
    """Self-distillation, ``mse(b(h), c(h))``: the gradient through the target is no part of the
    loss's curvature."""
    torch.manual_seed(0)
    model = curvopt.extend(_TwoHeads().to(DT))
    mse = curvopt.extend(nn.MSELoss())
    x = torch.randn(N, 4, dtype=DT)
    a, b = model(x)
    with pytest.raises((UnsupportedModuleError, ValueError, RuntimeError)):
        with curvopt.collect(ext.DiagGGNExact()):
            mse(a[:, :2], b).backward()
    assert_no_attributes(model)


class _Double(torch.autograd.Function):
    """``2 u`` as a custom ``autograd.Function``: its node's backward is Python."""

    generate_vmap_rule = True

    @staticmethod
    def forward(u):
        return 2 * u

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return 2 * grad


class _Doubled(nn.Module):
    """``b(double(tanh(a(x))))``, the doubling a custom ``autograd.Function`` or the op."""

    def __init__(self, python):
        super().__init__()
        self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 3)
        self.python = python
        self.doubled = None

    def forward(self, x):
        h = torch.tanh(self.a(x))
        self.doubled = _Double.apply(h) if self.python else 2 * h
        return self.b(self.doubled)


@pytest.mark.parametrize("python", [False, True], ids=["op", "function"])
def test_term_at_a_node_checked_after_it_or_before_it(python):
    """The check of what a node received runs in its one hook after it (an op's node) or before
    it (a custom ``autograd.Function``'s, whose backward is Python; a parameter's
    ``AccumulateGrad``, which passes nothing on): a term entering there passes at weight 0 with
    the reference's numbers and raises, naming the node, at weight 0.3; a term on a parameter
    raises before its ``p.grad`` is touched."""
    torch.manual_seed(0)
    plain = _Doubled(python).to(DT)
    model = curvopt.extend(copy.deepcopy(plain))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    x, y = torch.randn(N, 4, dtype=DT), torch.randint(0, 3, (N,))
    want = _reference(plain, x, y)
    node = "DoubleBackward" if python else "MulBackward0"
    for lam in (0.0, 0.0, 0.3, 0.0):
        clear_attributes(model, ALL_ATTRS)
        out = model(x)
        loss = lossfunc(out, y) + lam * (model.doubled**2).sum()
        if lam == 0.0:
            with curvopt.collect(ext.DiagGGNExact()):
                loss.backward()
            for name, p in model.named_parameters():
                assert_close(p.diag_ggn_exact.flatten(), want[name], name)
            continue
        with pytest.raises(UnsupportedModuleError, match=f"intermediate result .*{node}"):
            with curvopt.collect(ext.DiagGGNExact()):
                loss.backward()
        assert_no_attributes(model)
    model.zero_grad(set_to_none=True)
    out = model(x)
    with pytest.raises(UnsupportedModuleError, match="'a.weight' receives gradient from outside"):
        with curvopt.collect(ext.DiagGGNExact()):
            (lossfunc(out, y) + 0.3 * (model.a.weight**2).sum()).backward()
    assert model.a.weight.grad is None


def test_a_weight_unfrozen_after_extend_is_hooked_and_watched_at_its_next_forward():
    """A weight frozen at ``extend`` (no gradient hook: a tensor that does not require grad
    takes none) and unfrozen after gets its hook at its module's next forward
    (``frontend.hooks``, ``ModuleEntry.unhooked``), so its node is watched from the first pass
    on: a term on it raises, as on any extended weight, with no second ``extend``. The nodes
    the check watches are kept per graph structure and set of extended parameters
    (``Plan.regions``): the passes share one region. The passes around have the reference's
    numbers."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DT)
    model = copy.deepcopy(plain)
    model[0].weight.requires_grad_(False)
    curvopt.extend(model)
    model[0].weight.requires_grad_(True)
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    x, y = torch.randn(N, 4, dtype=DT), torch.randint(0, 3, (N,))
    want = _reference(plain, x, y)
    earlier = set(plan_cache())  # (the structures of the tests before)

    def run(lam, *extensions):
        clear_attributes(model, ALL_ATTRS)
        out = model(x)
        loss = lossfunc(out, y) + lam * (model[0].weight ** 2).sum()
        with curvopt.collect(ext.DiagGGNExact(), *extensions):
            loss.backward()
        for name, p in model.named_parameters():
            assert_close(p.diag_ggn_exact.flatten(), want[name], name)

    with pytest.raises(UnsupportedModuleError, match="'0.weight' receives gradient from outside"):
        run(0.3, ext.BatchGrad())  # (a first-order quantity would miss the term unwatched)
    assert_no_attributes(model)
    run(0.0)
    run(0.0)  # (the structure's region, kept)
    plans = [p for key, p in plan_cache().items() if key not in earlier and p.regions]
    assert len(plans) == 1 and len(plans[0].regions) == 1  # one structure, one region
