"""Second-order passes: bad input raises before anything is written; loss scaling and sums of
losses; several extensions in one pass equal separate passes; ``p.grad`` is untouched."""

import copy
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    ALL_ATTRS,
    DT,
    assert_close,
    assert_no_attributes,
    clear_attributes,
    extended_copy,
    ggn_reference,
    nearest_kronecker_dense,
    run_second_order,
    trainable,
)
from torch import nn

import curvopt
from curvopt import extensions as ext
from curvopt.errors import (
    ExtensionConflictError,
    MissingLossError,
    UnsupportedLossError,
    UnsupportedModuleError,
)

N = 3

SECOND = {
    "DiagGGNExact": lambda: ext.DiagGGNExact(),
    "BatchDiagGGNExact": lambda: ext.BatchDiagGGNExact(),
    "DiagGGNMC": lambda: ext.DiagGGNMC(),
    "BatchDiagGGNMC": lambda: ext.BatchDiagGGNMC(),
    "KFLR": lambda: ext.KFLR(),
    "KFAC": lambda: ext.KFAC(),
    "KFRA": lambda: ext.KFRA(),
    "DiagHessian": lambda: ext.DiagHessian(),
    "BatchDiagHessian": lambda: ext.BatchDiagHessian(),
}


def _mlp():
    return nn.Sequential(OrderedDict(fc1=nn.Linear(4, 5), act=nn.Tanh(), fc2=nn.Linear(5, 3))).to(
        DT
    )


def _data():
    return torch.randn(N, 4, dtype=DT), torch.randint(0, 3, (N,))


def _backward_raises(model, loss, error, *extensions, match=None):
    with pytest.raises(error, match=match) as info, curvopt.collect(*extensions):
        loss.backward()
    assert_no_attributes(model)
    return str(info.value)


# ------------------------------------------------------------------------------ missing loss


@pytest.mark.parametrize("name", list(SECOND))
def test_plain_loss_module_raises_missing_loss(name, seed):
    model = extended_copy(_mlp())
    x, y = _data()
    loss = nn.CrossEntropyLoss()(model(x), y)  # not extended
    message = _backward_raises(model, loss, MissingLossError, SECOND[name](), ext.BatchGrad())
    assert "extend" in message


@pytest.mark.parametrize("make_loss", ["functional", "sum-of-outputs"])
def test_loss_not_from_a_module_raises_missing_loss(make_loss, seed):
    model = extended_copy(_mlp())
    x, y = _data()
    loss = F.cross_entropy(model(x), y) if make_loss == "functional" else model(x).pow(2).sum()
    _backward_raises(model, loss, MissingLossError, ext.DiagGGNExact(), ext.KFLR(), ext.Variance())


def test_first_order_alone_needs_no_extended_loss(seed):
    model = extended_copy(_mlp())
    x, y = _data()
    loss = nn.CrossEntropyLoss()(model(x), y)
    with curvopt.collect(ext.BatchGrad()):
        loss.backward()
    assert model.fc1.weight.grad_batch.shape == (N, 5, 4)


# ------------------------------------------------------------------------------ bad losses


@pytest.mark.parametrize("name", ["DiagGGNExact", "DiagGGNMC", "KFLR", "KFAC", "BatchDiagGGNExact"])
@pytest.mark.parametrize("loss_cls", [nn.CrossEntropyLoss, nn.MSELoss, nn.BCEWithLogitsLoss])
def test_reduction_none_raises(loss_cls, name, seed):
    model = extended_copy(_mlp())
    x, y = _data()
    out = model(x)
    target = y if loss_cls is nn.CrossEntropyLoss else torch.rand_like(out)
    loss = curvopt.extend(loss_cls(reduction="none"))(out, target).sum()
    message = _backward_raises(model, loss, UnsupportedLossError, SECOND[name](), ext.BatchGrad())
    assert "reduction" in message and "none" in message


@pytest.mark.parametrize(
    "loss_cls, transform",
    [
        (nn.L1Loss, None),
        (nn.SmoothL1Loss, None),
        (nn.HuberLoss, None),
        (nn.NLLLoss, "log_softmax"),
        (nn.KLDivLoss, "log_softmax"),
    ],
)
@pytest.mark.parametrize("name", ["DiagGGNExact", "DiagGGNMC", "KFLR", "KFAC"])
def test_unsupported_loss_raises(loss_cls, transform, name, seed):
    model = extended_copy(_mlp())
    x, y = _data()
    out = model(x)
    if transform == "log_softmax":
        out = out.log_softmax(1)
    target = y if loss_cls is nn.NLLLoss else torch.rand_like(out).softmax(1)
    lossfunc = curvopt.extend(loss_cls(reduction="sum"))
    message = _backward_raises(model, lossfunc(out, target), UnsupportedLossError, SECOND[name]())
    assert loss_cls.__name__ in message


def test_unsupported_loss_is_fine_for_first_order(seed):
    model = extended_copy(_mlp())
    x, _ = _data()
    out = model(x)
    loss = curvopt.extend(nn.L1Loss())(out, torch.zeros_like(out))
    with curvopt.collect(ext.BatchGrad()):
        loss.backward()
    assert_close(model.fc2.weight.grad_batch.sum(0), model.fc2.weight.grad, "grad_batch")


@pytest.mark.parametrize("factor", [-1.0, -2.5])
@pytest.mark.parametrize("name", ["DiagGGNExact", "BatchDiagGGNMC", "KFLR", "KFAC"])
def test_negatively_scaled_loss_raises(factor, name, seed):
    model = extended_copy(_mlp())
    x, y = _data()
    loss = factor * curvopt.extend(nn.CrossEntropyLoss())(model(x), y)
    _backward_raises(model, loss, UnsupportedLossError, SECOND[name](), ext.BatchGrad())


# ------------------------------------------------------------------------------ bad modules


def _bn_model():
    return nn.Sequential(
        OrderedDict(
            fc=nn.Linear(4, 3),
            block=nn.Sequential(OrderedDict(bn=nn.BatchNorm1d(3), act=nn.Tanh())),
            out=nn.Linear(3, 3),
        )
    ).to(DT)


@pytest.mark.parametrize("name", ["BatchDiagGGNExact", "DiagHessian", "KFRA"])
def test_batchnorm_train_mode_raises(name, seed):
    """Per-sample quantities (not defined under batch statistics), ``DiagHessian`` and KFRA;
    the summed GGN ones go through (``tests/test_batchnorm_train_exact.py``: exact,
    ``tests/test_batchnorm_expectation.py``: Monte-Carlo)."""
    model = extended_copy(_bn_model()).train()
    x, y = _data()
    loss = curvopt.extend(nn.CrossEntropyLoss())(model(x), y)
    message = _backward_raises(model, loss, UnsupportedModuleError, SECOND[name]())
    assert "block.bn" in message and "BatchNorm1d" in message and "eval" in message


def test_batchnorm_eval_mode_works(seed):
    plain = _bn_model().eval()
    x, y = _data()
    blocks, _ = ggn_reference(plain, nn.CrossEntropyLoss(), x, y)
    model = extended_copy(plain)
    run_second_order(model, curvopt.extend(nn.CrossEntropyLoss()), x, y, ext.DiagGGNExact())
    for name, p in trainable(model).items():
        assert_close(p.diag_ggn_exact, torch.diagonal(blocks[name]).reshape(p.shape), name)


def test_dropout_in_train_mode_with_generic_module_is_the_fixed_masks_function(seed):
    """A module curvopt re-runs per sample in training mode: its GGN diagonal is that of the
    same function with the forward's dropout mask fixed (a twin multiplying by it)."""

    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(1 + torch.arange(4, dtype=DT) / 4)
            self.drop = nn.Dropout(0.5)

        def forward(self, x):
            return self.drop(x * self.w)

    class Fixed(nn.Module):
        def __init__(self, w, mask):
            super().__init__()
            self.w, self.mask = nn.Parameter(w.detach().clone()), mask

        def forward(self, x):
            return x * self.w * self.mask

    torch.manual_seed(3)
    fc = nn.Linear(4, 3).to(DT)
    model = curvopt.extend(nn.Sequential(OrderedDict(noisy=Noisy(), fc=copy.deepcopy(fc))))
    x, y = _data()
    state = torch.get_rng_state()
    loss = curvopt.extend(nn.CrossEntropyLoss())(model(x), y)
    with curvopt.collect(ext.DiagGGNExact()):
        loss.backward()
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(state)
        mask = F.dropout(torch.ones_like(x), 0.5, True)
    twin = nn.Sequential(OrderedDict(noisy=Fixed(model.noisy.w, mask), fc=fc))
    blocks, _ = ggn_reference(twin, nn.CrossEntropyLoss(), x, y)
    for name, p in trainable(model).items():
        assert_close(p.diag_ggn_exact, torch.diagonal(blocks[name]).reshape(p.shape), name)


def test_failed_pass_keeps_previous_results_intact(seed):
    """A pass that raises neither writes new results nor alters the ones already there."""
    model = extended_copy(_bn_model()).eval()
    x, y = _data()
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    run_second_order(model, lossfunc, x, y, ext.DiagGGNExact(), ext.BatchDiagGGNExact(), ext.KFLR())
    before = {
        (name, a): copy.deepcopy(p.__dict__[a])
        for name, p in model.named_parameters()
        for a in ("diag_ggn_exact", "diag_ggn_exact_batch", "kflr")
    }
    model.train()
    loss = lossfunc(model(x * 3), y)
    exts = (ext.DiagGGNExact(), ext.BatchDiagGGNExact(), ext.KFLR())
    with pytest.raises(UnsupportedModuleError), curvopt.collect(*exts):
        loss.backward()
    for (name, a), old in before.items():
        p = dict(model.named_parameters())[name]
        if a in p.__dict__:
            new = p.__dict__[a]
            for o, n_ in zip(
                old if isinstance(old, list) else [old], new if isinstance(new, list) else [new]
            ):
                assert torch.equal(o, n_), f"{name}.{a} changed by a failed pass"


# ------------------------------------------------------------------------------ conflicts


def test_conflicting_extensions_raise():
    with pytest.raises(ExtensionConflictError):
        curvopt.collect(ext.KFLR(kfac_approx="expand"), ext.KFLR(kfac_approx="reduce"))
    with pytest.raises(ExtensionConflictError):
        curvopt.collect(ext.DiagGGNMC(mc_samples=1), ext.DiagGGNMC(mc_samples=2))
    with pytest.raises(ValueError, match="kfac_approx"):
        ext.KFAC(kfac_approx="average")
    curvopt.collect(ext.KFLR(), ext.KFLR())  # identical duplicates are fine


# ------------------------------------------------------------------------------ scaling


def _quantities(model, keys=("diag_ggn_exact", "diag_ggn_exact_batch", "kflr", "diag_ggn_mc")):
    out = {}
    for name, p in trainable(model).items():
        for a in keys:
            v = getattr(p, a)
            out[name, a] = (
                torch.kron(*v)
                if isinstance(v, list) and len(v) == 2
                else (v[0] if isinstance(v, list) else v)
            )
    return out


def _scaled_pass(model, lossfunc, x, y, factor):
    clear_attributes(model, ALL_ATTRS)
    loss = curvopt.extend(lossfunc)(model(x), y)
    loss = loss if factor is None else factor * loss
    torch.manual_seed(3)
    with curvopt.collect(ext.DiagGGNExact(), ext.BatchDiagGGNExact(), ext.KFLR(), ext.DiagGGNMC()):
        loss.backward()
    return _quantities(model)


@pytest.mark.parametrize("factor", [2.0, 0.25])
def test_positively_scaled_loss_scales_curvature(factor, seed):
    model = extended_copy(_mlp())
    x, y = _data()
    lossfunc = nn.CrossEntropyLoss()
    base = _scaled_pass(model, lossfunc, x, y, None)
    scaled = _scaled_pass(model, lossfunc, x, y, factor)
    for key in base:
        assert_close(scaled[key], factor * base[key], f"{key} x {factor}")
    # the input-side Kronecker factor is a statistic of the inputs: not scaled
    assert_close(model.fc1.weight.kflr[1], x.T @ x / N, "A")


def test_loss_divided_inside_the_graph(seed):
    """``loss / 4`` and ``loss * 0.25`` are the same scaling."""
    model = extended_copy(_mlp())
    x, y = _data()
    base = _scaled_pass(model, nn.CrossEntropyLoss(), x, y, None)
    clear_attributes(model, ALL_ATTRS)
    loss = curvopt.extend(nn.CrossEntropyLoss())(model(x), y) / 4
    with curvopt.collect(ext.DiagGGNExact()):
        loss.backward()
    for name, p in trainable(model).items():
        assert_close(p.diag_ggn_exact, base[name, "diag_ggn_exact"] / 4, name)


def _two_losses(model, x, y, t, exts, which):
    """One pass with ``CE(out, y)`` (``which`` 0), ``0.5 * MSE(out, t)`` (1) or their sum (2)."""
    ce, mse = curvopt.extend(nn.CrossEntropyLoss()), curvopt.extend(nn.MSELoss())
    clear_attributes(model, ALL_ATTRS)
    out = model(x)
    loss = [lambda: ce(out, y), lambda: 0.5 * mse(out, t), lambda: ce(out, y) + 0.5 * mse(out, t)][
        which
    ]()
    with curvopt.collect(*exts()):
        loss.backward()


def test_sum_of_two_losses_on_one_output_adds_curvature(seed):
    """``CE(out, y) + 0.5 * MSE(out, t)``: the GGN of the sum is the sum of the GGNs."""
    model = extended_copy(_mlp())
    x, y = _data()
    t = torch.randn(N, 3, dtype=DT)
    keys = ("diag_ggn_exact", "diag_ggn_exact_batch")
    parts = []
    for which in range(3):
        _two_losses(model, x, y, t, lambda: (ext.DiagGGNExact(), ext.BatchDiagGGNExact()), which)
        parts.append(_quantities(model, keys))
    for key in parts[2]:
        assert_close(parts[2][key], parts[0][key] + parts[1][key], f"{key}")
    # the reference: J^T (H_ce + H_mse / 2) J
    blocks, _ = ggn_reference(
        model, lambda o, _: F.cross_entropy(o, y) + 0.5 * F.mse_loss(o, t), x, None
    )
    for name, p in trainable(model).items():
        assert_close(p.diag_ggn_exact, torch.diagonal(blocks[name]).reshape(p.shape), name)


@pytest.mark.parametrize("cls", [ext.KFLR, ext.KFAC])
def test_sum_of_two_losses_on_one_output_adds_kronecker_b(cls, seed):
    model = extended_copy(_mlp())
    x, y = _data()
    t = torch.randn(N, 3, dtype=DT)
    factors = []
    for which in range(3):
        torch.manual_seed(5)
        _two_losses(
            model, x, y, t, lambda: (cls(mc_samples=50000) if cls is ext.KFAC else cls(),), which
        )
        factors.append(
            {n: [f.clone() for f in getattr(p, cls.attr)] for n, p in trainable(model).items()}
        )
    tol = 1e-7 if cls is ext.KFLR else 0.1
    for name in trainable(model):
        first, second, both = (f[name] for f in factors)
        b = both[0]
        err = ((b - first[0] - second[0]).norm() / b.norm()).item()
        assert err < tol, f"{name} B: rel. error {err:.3g}"
        if len(both) == 2:
            assert_close(both[1], first[1], f"{name} A (a statistic of the inputs, not summed)")


def test_kflr_with_module_under_two_losses_is_the_nearest_kronecker_product(seed):
    """Two batches through one module under two losses: ``B1 (x) A1 + B2 (x) A2`` is not one
    Kronecker product; the factors are those of the nearest one (as for a module called
    twice), the biases' blocks add."""
    model = extended_copy(_mlp())
    (x1, y1), (x2, y2) = _data(), _data()
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    separate = []
    for x, y in ((x1, y1), (x2, y2)):
        run_second_order(model, lossfunc, x, y, ext.KFLR())
        separate.append({n: p.kflr for n, p in trainable(model).items()})
    clear_attributes(model, ALL_ATTRS)
    loss = lossfunc(model(x1), y1) + lossfunc(model(x2), y2)
    with curvopt.collect(ext.KFLR()):
        loss.backward()
    for name, p in trainable(model).items():
        uses = [s[name] for s in separate]
        if p.dim() == 1:
            assert_close(p.kflr[0], uses[0][0] + uses[1][0], name)
            continue
        dense = torch.kron(*uses[0]) + torch.kron(*uses[1])
        want = nearest_kronecker_dense(dense, p.shape[0], p.shape[1])
        assert_close(torch.kron(*p.kflr), want, name)


def test_sum_of_losses_on_two_batches_adds_diagonals(seed):
    model = extended_copy(_mlp())
    (x1, y1), (x2, y2) = _data(), _data()
    lossfunc = curvopt.extend(nn.CrossEntropyLoss(reduction="sum"))
    separate = []
    for x, y in ((x1, y1), (x2, y2)):
        run_second_order(model, lossfunc, x, y, ext.DiagGGNExact())
        separate.append({n: p.diag_ggn_exact for n, p in trainable(model).items()})
    clear_attributes(model, ALL_ATTRS)
    loss = lossfunc(model(x1), y1) + lossfunc(model(x2), y2)
    with curvopt.collect(ext.DiagGGNExact()):
        loss.backward()
    for name, p in trainable(model).items():
        assert_close(p.diag_ggn_exact, separate[0][name] + separate[1][name], name)


# ------------------------------------------------------------------------------ combined


class _Mixed(nn.Module):
    def __init__(self, flat_norm=False):
        super().__init__()
        self.flat_norm = flat_norm
        self.conv = nn.Conv1d(2, 3, 3, padding=1)
        self.norm = nn.LayerNorm(15 if flat_norm else 5)
        self.fc = nn.Linear(15, 4)

    def forward(self, x):
        h = self.conv(x)
        h = self.norm(h.flatten(1)) if self.flat_norm else self.norm(h).flatten(1)
        return self.fc(torch.tanh(h))


def _values(model, attrs):
    return {
        (name, a): copy.deepcopy(getattr(p, a))
        for name, p in trainable(model).items()
        for a in attrs
    }


def _same(a, b, what):
    if isinstance(a, list):
        assert len(a) == len(b), what
        for i, (u, v) in enumerate(zip(a, b)):
            assert_close(u, v, f"{what}[{i}]")
    else:
        assert_close(a, b, what)


@pytest.mark.parametrize("flat_norm", [False, True])  # True: LayerNorm on [N, D]
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_combined_equals_separate_passes_and_keeps_grad(reduction, flat_norm, seed):
    plain = _Mixed(flat_norm).to(DT)
    x = torch.randn(N, 2, 5, dtype=DT)
    y = torch.randint(0, 4, (N,))
    model = extended_copy(plain)
    lossfunc = curvopt.extend(nn.CrossEntropyLoss(reduction=reduction))
    # p.grad of the plain model without collect
    plain_loss = nn.CrossEntropyLoss(reduction=reduction)(plain(x), y)
    plain_loss.backward()
    grads = {n: p.grad.clone() for n, p in plain.named_parameters()}
    exts = {
        "diag_ggn_exact": ext.DiagGGNExact,
        "kflr": ext.KFLR,
        "grad_batch": ext.BatchGrad,
        "variance": ext.Variance,
    }
    separate = {}
    for attr, cls in exts.items():
        run_second_order(model, lossfunc, x, y, cls())
        separate.update(_values(model, [attr]))
        for name, p in model.named_parameters():
            assert_close(p.grad, grads[name], f"{name}.grad with {cls.__name__}")
            for other in set(exts) - {attr}:
                assert not hasattr(p, other), f"{name} got {other} without asking"
    run_second_order(model, lossfunc, x, y, *(cls() for cls in exts.values()))
    combined = _values(model, list(exts))
    for key, value in separate.items():
        _same(combined[key], value, f"{key}")
    for name, p in model.named_parameters():
        assert_close(p.grad, grads[name], f"{name}.grad combined")


def test_outside_collect_nothing_is_written(seed):
    model = extended_copy(_mlp())
    x, y = _data()
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    with curvopt.collect(ext.DiagGGNExact(), ext.KFLR()):
        loss = lossfunc(model(x), y)  # forward inside, backward outside
    loss.backward()
    assert_no_attributes(model)


def test_repeated_passes_overwrite_not_accumulate(seed):
    model = extended_copy(_mlp())
    x, y = _data()
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    first = {}
    for i in range(2):
        loss = lossfunc(model(x), y)
        with curvopt.collect(ext.DiagGGNExact(), ext.KFLR(), ext.BatchDiagGGNExact()):
            loss.backward()
        values = _values(model, ["diag_ggn_exact", "kflr", "diag_ggn_exact_batch"])
        if i == 0:
            first = values
    for key in first:
        _same(values[key], first[key], f"{key} second pass")
