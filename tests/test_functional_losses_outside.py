"""Second order with a loss computed functionally after the model's forward, without an extended
loss module (``curvopt.entry.functional``): ``F.cross_entropy(model(X), y)`` (weight,
ignore_index, label smoothing, K-dim and flattened rows, a temperature and a slice between),
a loss module that was not extended, ``F.nll_loss`` after ``F.log_softmax``, ``F.mse_loss``,
``F.binary_cross_entropy_with_logits`` (weight, pos_weight).

Every quantity is compared in float64 with torch.func references (``reference``) computed on a
plain copy of the model with the same loss, and every optimizer's steps with the steps of the
same loop on an extended loss module. Losses that are not read raise ``MissingLossError``.
"""

import copy

import pytest
import reference
import torch
import torch.nn.functional as F
from torch import nn

import curvopt
from curvopt import extensions as ext
from curvopt.errors import MissingLossError, UnsupportedLossError
from curvopt.optim import EKFAC, KFAC, DiagGGNNewton

DT = torch.float64
C, T, V = 4, 3, 7


class Sequence(nn.Module):
    """``[N, T]`` tokens -> ``[N, T, C]`` logits."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(V, 5), nn.Linear(5, C)

    def forward(self, x):
        return self.head(torch.tanh(self.embed(x)))


def _mlp():
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, C))


def _cnn():
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, stride=2, padding=1, dilation=1),
        nn.Sigmoid(),
        nn.Conv2d(3, 2, 2, padding=1, groups=1),
        nn.Flatten(),
        nn.Linear(2 * 4 * 4, C),
    )


def _data(kind, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    if kind == "mlp":
        return 2 * torch.randn(n, 3, generator=g, dtype=DT)
    if kind == "cnn":
        return torch.randn(n, 2, 5, 5, generator=g, dtype=DT)
    return torch.randint(0, V, (n, T), generator=g)


MODELS = {"mlp": _mlp, "cnn": _cnn, "sequence": Sequence}
WEIGHT = torch.tensor([0.5, 2.0, 1.0, 3.0], dtype=DT)
GEN = torch.Generator()


def _labels(n, shape=()):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, C, (n, *shape), generator=g)


#: name -> (model, functional loss ``loss(out, y, reduction)``, target for batch size n)
CASES = {
    "ce": ("mlp", lambda o, y, r: F.cross_entropy(o, y, reduction=r), _labels),
    "ce_weight_ignore": (
        "mlp",
        lambda o, y, r: F.cross_entropy(o, y, weight=WEIGHT, ignore_index=2, reduction=r),
        _labels,
    ),
    "ce_smoothing_ignore": (
        "cnn",
        lambda o, y, r: F.cross_entropy(o, y, ignore_index=0, label_smoothing=0.2, reduction=r),
        _labels,
    ),
    "ce_probabilities": (
        "mlp",
        lambda o, y, r: F.cross_entropy(o, y, label_smoothing=0.1, reduction=r),
        lambda n: torch.softmax(torch.randn(n, C, generator=GEN.manual_seed(4), dtype=DT), 1),
    ),
    "ce_temperature_slice": (
        "mlp",
        lambda o, y, r: F.cross_entropy(o[:, :3] / 2.0, y % 3, reduction=r),
        _labels,
    ),
    "ce_module_not_extended": (
        "cnn",
        lambda o, y, r: nn.CrossEntropyLoss(label_smoothing=0.1, reduction=r)(o, y),
        _labels,
    ),
    "ce_kdim": (
        "sequence",
        lambda o, y, r: F.cross_entropy(o.transpose(1, 2), y, ignore_index=1, reduction=r),
        lambda n: _labels(n, (T,)),
    ),
    "ce_flattened_rows": (
        "sequence",
        lambda o, y, r: F.cross_entropy(o.reshape(-1, C), y.reshape(-1), reduction=r),
        lambda n: _labels(n, (T,)),
    ),
    "nll_log_softmax": (
        "mlp",
        lambda o, y, r: F.nll_loss(F.log_softmax(o, 1), y, weight=WEIGHT, reduction=r),
        _labels,
    ),
    "nll_log_softmax_flattened": (
        "sequence",
        lambda o, y, r: F.nll_loss(F.log_softmax(o, -1).view(-1, C), y.view(-1), reduction=r),
        lambda n: _labels(n, (T,)),
    ),
    "mse": (
        "cnn",
        lambda o, y, r: F.mse_loss(o, y, reduction=r),
        lambda n: torch.randn(n, C, generator=torch.Generator().manual_seed(2), dtype=DT),
    ),
    "bce_weight_pos_weight": (
        "mlp",
        lambda o, y, r: F.binary_cross_entropy_with_logits(
            o, y, weight=WEIGHT, pos_weight=WEIGHT.flip(0), reduction=r
        ),
        lambda n: torch.rand(n, C, generator=torch.Generator().manual_seed(3), dtype=DT),
    ),
}
#: read from the log-probabilities: DiagHessian cannot see the log-softmax's curvature
NO_HESSIAN = {"nll_log_softmax", "nll_log_softmax_flattened"}


def _problem(case, n=5):
    kind, loss, target = CASES[case]
    torch.manual_seed(0)
    plain = MODELS[kind]().to(DT)
    model = curvopt.extend(copy.deepcopy(plain))
    return plain, model, loss, _data(kind, n), target(n)


def _collected(model, loss, X, y, reduction, extension):
    with curvopt.collect(extension):
        out = model(X)
        assert type(out).__name__ == "Watched"
        loss(out, y, reduction).backward()
    return {k: getattr(p, extension.attr) for k, p in model.named_parameters()}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_ggn_diagonal_of_a_functional_loss(case, reduction):
    plain, model, loss, X, y = _problem(case)
    got = _collected(model, loss, X, y, reduction, ext.DiagGGNExact())
    blocks, _ = reference.ggn(plain, lambda o, t: loss(o, t, reduction), X, y)
    for name, block in blocks.items():
        want = block.diagonal().reshape(got[name].shape)
        torch.testing.assert_close(got[name], want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("case", ["ce_weight_ignore", "ce_kdim", "nll_log_softmax", "mse"])
def test_kflr_of_a_functional_loss(case, reduction):
    plain, model, loss, X, y = _problem(case)
    _collected(model, loss, X, y, reduction, ext.KFLR())
    layers = reference.kronecker(plain, lambda o, t: loss(o, t, reduction), X, y)
    modules = dict(model.named_modules())
    for name, factors in layers.items():
        if isinstance(modules[name], nn.Embedding):  # the reference's (B, A); p.kflr: vec order
            factors = factors[::-1]
        assert len(modules[name].weight.kflr) == 2
        for got_f, want_f in zip(modules[name].weight.kflr, factors):
            torch.testing.assert_close(got_f, want_f, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", sorted(set(CASES) - NO_HESSIAN - {"ce_kdim"}))
def test_hessian_diagonal_of_a_functional_loss(case):
    plain, model, loss, X, y = _problem(case)
    got = _collected(model, loss, X, y, "mean", ext.DiagHessian())
    want, _ = reference.hessian(plain, lambda o, t: loss(o, t, "mean"), X, y)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", sorted(NO_HESSIAN))
def test_hessian_diagonal_after_a_log_softmax_raises(case):
    _, model, loss, X, y = _problem(case)
    with pytest.raises(Exception, match="DiagHessian"):
        _collected(model, loss, X, y, "mean", ext.DiagHessian())


OPTIMIZERS = {
    "KFAC": lambda p: KFAC(p, lr=0.2, damping=0.1, curvature="kflr"),
    "KFAC_mc": lambda p: KFAC(p, lr=0.2, damping=0.1),
    "EKFAC": lambda p: EKFAC(p, 0.2, 0.1, "kflr"),
    "DiagGGNNewton": lambda p: DiagGGNNewton(p, lr=0.2, damping=0.1, curvature="exact"),
}


def _train(name, functional, steps=3):
    torch.manual_seed(0)
    model = curvopt.extend(_mlp().to(DT))
    opt = OPTIMIZERS[name](model.parameters())
    lossfunc = curvopt.extend(nn.CrossEntropyLoss(label_smoothing=0.1))
    X, y = _data("mlp", 8), _labels(8)
    for _ in range(steps):
        opt.zero_grad()
        for rows in (slice(0, 5), slice(5, 8)):  # two micro-batches of unequal size
            out = model(X[rows])
            loss = F.cross_entropy(out, y[rows], label_smoothing=0.1) if functional else None
            (loss if functional else lossfunc(out, y[rows])).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizers_step_on_a_functional_loss_as_on_an_extended_one(name):
    torch.manual_seed(0)
    want = _train(name, functional=False)
    torch.manual_seed(0)
    got = _train(name, functional=True)
    assert torch.equal(got, want)
    torch.manual_seed(0)
    assert not torch.equal(want, torch.cat([p.reshape(-1) for p in _mlp().to(DT).parameters()]))


UNREAD = {
    "written_out": lambda o, y: (o - o.logsumexp(1, keepdim=True)).gather(1, y[:, None]).mean(),
    "nll_on_logits": lambda o, y: F.nll_loss(o, y),
    "nll_on_log_softmax_dim0": lambda o, y: F.nll_loss(F.log_softmax(o, 0), y),
    "reduction_none": lambda o, y: F.cross_entropy(o, y, reduction="none").mean(),
    "mse_weight": lambda o, y: F.mse_loss(o, o.detach() + 1, weight=torch.ones(4, C, dtype=DT)),
}


@pytest.mark.parametrize("case", sorted(UNREAD))
def test_a_loss_that_is_not_read_raises(case):
    torch.manual_seed(0)
    model = curvopt.extend(_mlp().to(DT))
    opt = KFAC(model.parameters(), lr=0.1, damping=0.1)
    X, y = _data("mlp", 4), _labels(4)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(MissingLossError, match="F.cross_entropy"):
        UNREAD[case](model(X), y).backward()
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_an_extended_loss_module_on_watched_outputs_counts_once():
    """The loss module's own record is kept, the functional one made inside it dropped: the
    GGN diagonal is the reference's, not twice it."""
    plain, model, _, X, y = _problem("ce")
    lossfunc = curvopt.extend(nn.CrossEntropyLoss(weight=WEIGHT))
    got = _collected(model, lambda o, t, r: lossfunc(o, t), X, y, "mean", ext.DiagGGNExact())
    blocks, _ = reference.ggn(plain, lambda o, t: F.cross_entropy(o, t, weight=WEIGHT), X, y)
    for name, block in blocks.items():
        torch.testing.assert_close(got[name], block.diagonal().reshape(got[name].shape))


def test_outputs_stay_plain_without_second_order():
    model = curvopt.extend(_mlp().to(DT))
    X = _data("mlp", 3)
    assert type(model(X)) is torch.Tensor  # nothing open, nothing armed on its parameters
    other = curvopt.extend(_mlp().to(DT))
    opt = KFAC(other.parameters(), lr=0.1, damping=0.1)  # armed on another model's
    assert type(model(X)) is torch.Tensor and type(other(X)) is not torch.Tensor
    del opt
    with curvopt.collect(ext.BatchGrad()):
        out = model(X)
        assert type(out) is torch.Tensor  # first order needs no loss
        out.sum().backward()
    with curvopt.collect(ext.DiagGGNMC()):
        out = model(X)
        loss = F.cross_entropy(out, _labels(3))
        assert type(loss) is torch.Tensor and type(out.argmax(1)) is torch.Tensor
        assert repr(out).startswith("tensor(")
        loss.backward()


class SmoothedCrossEntropy(nn.modules.loss._Loss):
    """A user's loss class (a loss module to ``extend``: torch's loss base class) without a rule
    of its own, returning ``F.cross_entropy``'s result."""

    def __init__(self, reduction):
        super().__init__(reduction=reduction)

    def forward(self, logits, target):
        return F.cross_entropy(logits, target, label_smoothing=0.1, reduction=self.reduction)


class DoubledCrossEntropy(SmoothedCrossEntropy):
    """As above, but its result is not the functional call's: curvopt cannot read it."""

    def forward(self, logits, target):
        return 2 * super().forward(logits, target)


#: name -> (model, extended loss module for a reduction, the same loss functionally, target)
RULELESS = {
    "nll_module": (
        "mlp",
        lambda r: nn.NLLLoss(weight=WEIGHT, reduction=r),
        lambda o, y, r: F.nll_loss(F.log_softmax(o, 1), y, weight=WEIGHT, reduction=r),
        _labels,
    ),
    "nll_module_kdim": (
        "sequence",
        lambda r: nn.NLLLoss(ignore_index=1, reduction=r),
        lambda o, y, r: F.nll_loss(
            F.log_softmax(o.transpose(1, 2), 1), y, ignore_index=1, reduction=r
        ),
        lambda n: _labels(n, (T,)),
    ),
    "user_class": (
        "cnn",
        SmoothedCrossEntropy,
        lambda o, y, r: F.cross_entropy(o, y, label_smoothing=0.1, reduction=r),
        _labels,
    ),
}


def _ruleless(case, reduction):
    """``(plain model, extended model, module loss(out, y), functional loss, X, y)``: the
    module's input is the log-softmax where the functional loss takes one."""
    kind, make_module, functional, target = RULELESS[case]
    torch.manual_seed(0)
    plain = MODELS[kind]().to(DT)
    lossfunc = curvopt.extend(make_module(reduction))
    if case == "nll_module":
        module_loss = lambda o, y: lossfunc(F.log_softmax(o, 1), y)  # noqa: E731
    elif case == "nll_module_kdim":
        module_loss = lambda o, y: lossfunc(F.log_softmax(o.transpose(1, 2), 1), y)  # noqa: E731
    else:
        module_loss = lossfunc
    model = curvopt.extend(copy.deepcopy(plain))
    loss = lambda o, y: functional(o, y, reduction)  # noqa: E731
    return plain, model, module_loss, loss, _data(kind, 5), target(5)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("case", sorted(RULELESS))
def test_an_extended_loss_module_without_a_rule_is_read_as_its_functional_loss(case, reduction):
    """``curvopt.extend(nn.NLLLoss())`` after a log-softmax, or a user's class returning
    ``F.cross_entropy``'s result: the GGN diagonal and KFLR of the functional loss it returns."""
    plain, model, module_loss, functional, X, y = _ruleless(case, reduction)
    got = _collected(model, lambda o, t, r: module_loss(o, t), X, y, reduction, ext.DiagGGNExact())
    blocks, _ = reference.ggn(plain, functional, X, y)
    for name, block in blocks.items():
        want = block.diagonal().reshape(got[name].shape)
        torch.testing.assert_close(got[name], want, rtol=1e-10, atol=1e-12)
    _collected(model, lambda o, t, r: module_loss(o, t), X, y, reduction, ext.KFLR())
    modules = dict(model.named_modules())
    for name, factors in reference.kronecker(plain, functional, X, y).items():
        if isinstance(modules[name], nn.Embedding):  # the reference's (B, A); p.kflr: vec order
            factors = factors[::-1]
        for got_f, want_f in zip(modules[name].weight.kflr, factors):
            torch.testing.assert_close(got_f, want_f, rtol=1e-10, atol=1e-12)


def test_a_user_loss_class_returning_a_cross_entropy_has_its_hessian_diagonal():
    plain, model, module_loss, functional, X, y = _ruleless("user_class", "mean")
    got = _collected(model, lambda o, t, r: module_loss(o, t), X, y, "mean", ext.DiagHessian())
    want, _ = reference.hessian(plain, functional, X, y)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", ["nll_module", "nll_module_kdim"])
def test_hessian_diagonal_through_an_extended_nll_loss_raises(case):
    _, model, module_loss, _, X, y = _ruleless(case, "mean")
    with pytest.raises(Exception, match="DiagHessian"):
        _collected(model, lambda o, t, r: module_loss(o, t), X, y, "mean", ext.DiagHessian())


@pytest.mark.parametrize("name", ["KFAC", "EKFAC"])
def test_optimizers_step_on_an_extended_nll_loss_as_on_the_functional_one(name):
    def train(lossfunc):
        torch.manual_seed(0)
        model = curvopt.extend(_mlp().to(DT))
        opt = OPTIMIZERS[name](model.parameters())
        X, y = _data("mlp", 8), _labels(8)
        for _ in range(3):
            opt.zero_grad()
            lossfunc(F.log_softmax(model(X), 1), y).backward()
            opt.step()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    want = train(F.nll_loss)
    assert torch.equal(train(curvopt.extend(nn.NLLLoss())), want)


def test_an_extended_loss_module_curvopt_cannot_read_raises():
    """A class without a rule whose result is not a recognised call's names itself; an extended
    ``NLLLoss`` on logits (no log-softmax) is a loss curvopt does not read."""
    _, model, _, X, y = _problem("ce")
    doubled = curvopt.extend(DoubledCrossEntropy("mean"))
    with pytest.raises(UnsupportedLossError, match="DoubledCrossEntropy"):
        _collected(model, lambda o, t, r: doubled(o, t), X, y, None, ext.KFLR())
    nll = curvopt.extend(nn.NLLLoss())
    with pytest.raises(MissingLossError, match="F.cross_entropy"):
        _collected(model, lambda o, t, r: nll(o, t), X, y, None, ext.KFLR())
