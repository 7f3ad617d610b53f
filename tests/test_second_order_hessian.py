"""``DiagHessian`` / ``BatchDiagHessian`` against ``torch.func.hessian`` of the loss w.r.t. the
parameters, and ``KFRA`` (Botev et al., 2017) against ``KFLR`` and its recursion.

The Hessian diagonal includes the second derivatives of nonlinearities; ops whose curvature
the engine cannot account for must raise instead of returning a wrong diagonal.
"""

import copy
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    DT,
    assert_close,
    assert_no_attributes,
    extended_copy,
    ggn_reference,
    hessian_reference,
    run_second_order,
    trainable,
)
from torch import nn

import curvopt
from curvopt import extensions as ext
from curvopt.errors import CurvoptError, UnsupportedModuleError

N = 3

LOSSES = {
    "ce": nn.CrossEntropyLoss,
    "mse": nn.MSELoss,
    "bce": nn.BCEWithLogitsLoss,
}

ACTIVATIONS = {
    "sigmoid": nn.Sigmoid,
    "tanh": nn.Tanh,
    "elu": lambda: nn.ELU(alpha=0.7),
    "selu": nn.SELU,
    "gelu": nn.GELU,
    "gelu-tanh": lambda: nn.GELU(approximate="tanh"),
    "silu": nn.SiLU,
    "softplus": lambda: nn.Softplus(beta=1.5),
    "logsigmoid": nn.LogSigmoid,
    "relu": nn.ReLU,
}


def _target(loss_name, out):
    if loss_name == "ce":
        shape = list(out.shape)
        classes = shape.pop(1)
        return torch.randint(0, classes, shape)
    return torch.randn_like(out) if loss_name == "mse" else torch.rand_like(out)


def check_hessian(plain, x, loss_name, reduction="mean", target=None, lossfunc=None):
    plain = plain.to(DT)
    with torch.no_grad():
        out = plain(x)
    target = _target(loss_name, out) if target is None else target
    lossfunc = LOSSES[loss_name](reduction=reduction) if lossfunc is None else lossfunc
    diag, per_sample = hessian_reference(plain, lossfunc, x, target)
    model = extended_copy(plain)
    run_second_order(
        model,
        curvopt.extend(copy.deepcopy(lossfunc)),
        x,
        target,
        ext.DiagHessian(),
        ext.BatchDiagHessian(),
    )
    for name, p in trainable(model).items():
        assert_close(p.diag_h, diag[name], f"{name}.diag_h")
        assert_close(p.diag_h_batch, per_sample[name], f"{name}.diag_h_batch")
        assert_close(p.diag_h_batch.sum(0), p.diag_h, f"{name}: batch terms sum")
    return model, diag


def _mlp(act):
    return nn.Sequential(
        nn.Linear(4, 5), ACTIVATIONS[act](), nn.Linear(5, 4), ACTIVATIONS[act](), nn.Linear(4, 3)
    )


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("loss_name", list(LOSSES))
@pytest.mark.parametrize("act", list(ACTIVATIONS))
def test_mlp(act, loss_name, reduction, seed):
    x = torch.randn(N, 4, dtype=DT)
    check_hessian(_mlp(act), x, loss_name, reduction)


class Residual(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.inp = nn.Linear(4, 5)
        self.fc1 = nn.Linear(5, 5)
        self.act = ACTIVATIONS[act]()
        self.fc2 = nn.Linear(5, 5)
        self.out = nn.Linear(5, 3)

    def forward(self, x):
        h = self.inp(x)
        h = h + self.fc2(self.act(self.fc1(h)))
        return self.out(torch.tanh(h) + h)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("loss_name", list(LOSSES))
@pytest.mark.parametrize("act", ["sigmoid", "gelu", "softplus"])
def test_residual(act, loss_name, reduction, seed):
    check_hessian(Residual(act), torch.randn(N, 4, dtype=DT), loss_name, reduction)


class Functional(nn.Module):
    """Nonlinearities called functionally, one of them on the raw input."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 5)
        self.fc2 = nn.Linear(5, 3)

    def forward(self, x):
        return self.fc2(F.silu(self.fc1(torch.sigmoid(x))) * 0.5 - 1)


def _cnn():
    return nn.Sequential(
        nn.Conv1d(2, 3, 3, padding=1),
        nn.Tanh(),
        nn.Conv1d(3, 2, 2, stride=2),
        nn.Sigmoid(),
        nn.Flatten(),
        nn.Linear(4, 3),
    )


def _sequence():
    return nn.Sequential(
        nn.Linear(3, 4), nn.ELU(), nn.Linear(4, 2), nn.Softplus(), nn.Flatten(), nn.Linear(10, 3)
    )


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.out = nn.Linear(4, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.shared(torch.tanh(self.shared(x)))))


class _Emb(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(6, 3)
        self.fc = nn.Linear(3, 3)

    def forward(self, idx):
        return self.fc(torch.tanh(self.emb(idx))).mean(1)


def _bn_eval():
    """BatchNorm (eval) on ``[N, C, L]``, between a conv and a curved activation."""
    bn = nn.BatchNorm1d(3)
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-1, 1)
    return nn.Sequential(nn.Conv1d(2, 3, 2), bn.eval(), nn.Sigmoid(), nn.Flatten(), nn.Linear(9, 3))


def _bn_eval_2d():
    bn = _bn_eval()[1]
    return nn.Sequential(nn.Linear(4, 3), bn, nn.Tanh(), nn.Linear(3, 3))


def _frozen():
    model = _mlp("tanh")
    model[2].weight.requires_grad_(False)
    return model


def _x(*shape):
    return lambda: torch.randn(N, *shape, dtype=DT)


ARCHS = {
    "functional": (Functional, _x(4)),
    "cnn": (_cnn, _x(2, 5)),
    "sequence": (_sequence, _x(5, 3)),
    "single-layer": (lambda: nn.Sequential(nn.Linear(4, 3)), _x(4)),
    "curved-last": (lambda: nn.Sequential(nn.Linear(4, 3), nn.Tanh()), _x(4)),
    "tanh-of-tanh": (
        lambda: nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Tanh(), nn.Linear(3, 3)),
        _x(4),
    ),
    "conv-groups": (
        lambda: nn.Sequential(
            nn.Conv1d(2, 4, 3, groups=2), nn.SiLU(), nn.Flatten(), nn.Linear(12, 3)
        ),
        _x(2, 5),
    ),
    "conv-transpose": (
        lambda: nn.Sequential(
            nn.ConvTranspose1d(2, 2, 2, stride=2), nn.Sigmoid(), nn.Flatten(), nn.Linear(8, 3)
        ),
        _x(2, 2),
    ),
    "conv-maxpool": (
        lambda: nn.Sequential(
            nn.Conv2d(1, 2, 2), nn.Softplus(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(2, 3)
        ),
        _x(1, 3, 3),
    ),
    "embedding": (_Emb, lambda: torch.randint(0, 6, (N, 4))),
    "batchnorm-eval": (_bn_eval, _x(2, 4)),
    "batchnorm-eval-2d": (_bn_eval_2d, _x(4)),
    "frozen-layer": (_frozen, _x(4)),
}


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(5, 3)
        self.out = nn.Linear(3, 5, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, idx):
        return self.out(torch.tanh(self.emb(idx))).mean(1)


class _LinearTwice(nn.Module):
    """``y = W (W x + b) + b``: quadratic in ``W`` without any nonlinearity."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(4, 4)

    def forward(self, x):
        return self.shared(self.shared(x))


SHARED = {
    "linear-twice": (_LinearTwice, _x(4)),
    "used-twice": (_Twice, _x(4)),
    "tied": (_Tied, lambda: torch.randint(0, 5, (N, 3))),
}


#: the module named by the error for each shared-parameter case
_SHARED_OWNER = {"linear-twice": "'shared'", "used-twice": "'shared'", "tied": "'emb'"}


@pytest.mark.parametrize("case", list(SHARED))
def test_shared_parameter_is_rejected(case, seed):
    """``y = W f(W x)`` has cross second derivatives between the uses of ``W``, which DiagHessian
    does not implement: the pass raises ``UnsupportedModuleError`` naming the module and the
    reason, and writes nothing (never a diagonal without the cross terms)."""
    make, inputs = SHARED[case]
    plain = make().to(DT)
    x = inputs()
    with torch.no_grad():
        target = _target("mse", plain(x))
    model = extended_copy(plain)
    with pytest.raises(UnsupportedModuleError, match="used by several calls") as info:
        run_second_order(
            model,
            curvopt.extend(nn.MSELoss(reduction="sum")),
            x,
            target,
            ext.DiagHessian(),
            ext.BatchDiagHessian(),
        )
    assert _SHARED_OWNER[case] in str(info.value), str(info.value)
    assert_no_attributes(model)


@pytest.mark.parametrize("loss_name", list(LOSSES))
@pytest.mark.parametrize("case", list(ARCHS))
def test_architectures(case, loss_name, seed):
    make, inputs = ARCHS[case]
    check_hessian(make(), inputs(), loss_name, "mean")


@pytest.mark.parametrize("act", ["tanh", "relu"])
def test_single_sample(act, seed):
    check_hessian(_mlp(act), torch.randn(1, 4, dtype=DT), "ce", "sum")


def test_hessian_differs_from_ggn_for_curved_activations(seed):
    """Guard against a DiagHessian that returns the GGN diagonal; with ReLU they agree."""
    x = torch.randn(N, 4, dtype=DT)
    y = torch.randint(0, 3, (N,))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    for act, equal in (("tanh", False), ("relu", True)):
        model = extended_copy(_mlp(act).to(DT))
        run_second_order(model, lossfunc, x, y, ext.DiagHessian(), ext.DiagGGNExact())
        w = model[0].weight
        assert torch.allclose(w.diag_h, w.diag_ggn_exact) == equal, act


def test_scaled_and_summed_losses(seed):
    """``2 * CE + MSE / 2`` on one output: the Hessian of the total loss."""
    plain = _mlp("tanh").to(DT)
    x = torch.randn(N, 4, dtype=DT)
    y = torch.randint(0, 3, (N,))
    t = torch.randn(N, 3, dtype=DT)

    def total(o, _):
        return 2 * F.cross_entropy(o, y) + F.mse_loss(o, t) / 2

    diag, per_sample = hessian_reference(plain, total, x, None)
    model = extended_copy(plain)
    ce, mse = curvopt.extend(nn.CrossEntropyLoss()), curvopt.extend(nn.MSELoss())
    out = model(x)
    loss = 2 * ce(out, y) + mse(out, t) / 2
    with curvopt.collect(ext.DiagHessian(), ext.BatchDiagHessian()):
        loss.backward()
    for name, p in trainable(model).items():
        assert_close(p.diag_h, diag[name], name)
        assert_close(p.diag_h_batch, per_sample[name], name)


# ------------------------------------------------------------------------------ unsupported


class Square(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        h = self.fc(x)
        return h * h


class Softmaxed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 5)
        self.fc2 = nn.Linear(5, 3)

    def forward(self, x):
        return self.fc2(self.fc1(x).softmax(-1))


class Elementwise(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fc1 = nn.Linear(4, 5)
        self.fc2 = nn.Linear(5, 3)
        self.fn = fn

    def forward(self, x):
        return self.fc2(self.fn(self.fc1(x)))


class _Cube(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x**2 * g


class RawScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.rand(4) + 0.5)

    def forward(self, x):
        return torch.tanh(x * self.w)


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(4, 2, batch_first=True)

    def forward(self, x):
        x = x.unsqueeze(1)
        return self.mha(x, x, x, need_weights=False)[0]


UNSUPPORTED = {
    "product": (lambda: Square(), None),
    "softmax": (lambda: Softmaxed(), None),
    "exp": (lambda: Elementwise(torch.exp), None),
    "sin": (lambda: Elementwise(torch.sin), None),
    "pow": (lambda: Elementwise(lambda h: h.pow(3)), None),
    "custom-function": (lambda: Elementwise(_Cube.apply), None),
    "layernorm": (
        lambda: nn.Sequential(
            OrderedDict(fc=nn.Linear(4, 5), ln=nn.LayerNorm(5), out=nn.Linear(5, 3))
        ),
        "ln",
    ),
    "raw-parameter": (
        lambda: nn.Sequential(OrderedDict(scale=RawScale(), out=nn.Linear(4, 3))),
        "scale",
    ),
    "curved-after-output": (lambda: nn.Sequential(nn.Linear(4, 3), nn.Hardswish()), None),
    "attention": (
        lambda: nn.Sequential(
            OrderedDict(
                fc=nn.Linear(4, 4), attn=_Attention(), flat=nn.Flatten(), out=nn.Linear(4, 3)
            )
        ),
        "attn",
    ),
}


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unseen_curvature_raises(case, batched, seed):
    make, path = UNSUPPORTED[case]
    plain = make().to(DT)
    model = extended_copy(plain)
    x = torch.randn(N, 4, dtype=DT)
    y = torch.randint(0, 3, (N,))
    loss = curvopt.extend(nn.CrossEntropyLoss())(model(x), y)
    extension = ext.BatchDiagHessian() if batched else ext.DiagHessian()
    with (
        pytest.raises(CurvoptError) as info,
        curvopt.collect(extension, ext.DiagGGNExact(), ext.BatchGrad()),
    ):
        loss.backward()
    if path is not None:
        assert path in str(info.value), str(info.value)
    assert_no_attributes(model)


def test_unseen_curvature_reference_really_differs(seed):
    """The unsupported cases are not secretly GGN-equal: their Hessian has residual terms."""
    plain = Elementwise(torch.exp).to(DT)
    x = torch.randn(N, 4, dtype=DT)
    y = torch.randint(0, 3, (N,))
    diag, _ = hessian_reference(plain, nn.CrossEntropyLoss(), x, y)
    blocks, _ = ggn_reference(plain, nn.CrossEntropyLoss(), x, y)
    assert not torch.allclose(diag["fc1.weight"].flatten(), torch.diagonal(blocks["fc1.weight"]))


# ------------------------------------------------------------------------------ KFRA


KFRA_ACTS = ["tanh", "sigmoid", "relu"]


@pytest.mark.parametrize("loss_name", list(LOSSES))
@pytest.mark.parametrize("act", KFRA_ACTS)
def test_kfra_equals_kflr_for_one_sample(act, loss_name, seed):
    plain = _mlp(act).to(DT)
    x = torch.randn(1, 4, dtype=DT)
    with torch.no_grad():
        target = _target(loss_name, plain(x))
    lossfunc = LOSSES[loss_name]()
    blocks, _ = ggn_reference(plain, lossfunc, x, target)
    model = extended_copy(plain)
    run_second_order(model, curvopt.extend(lossfunc), x, target, ext.KFRA(), ext.KFLR())
    for name, p in trainable(model).items():
        assert len(p.kfra) == len(p.kflr) == (2 if p.dim() > 1 else 1)
        for i, (a, b) in enumerate(zip(p.kfra, p.kflr)):
            assert_close(a, b, f"{name}.kfra[{i}]")
        assert_close(
            torch.kron(*p.kfra) if p.dim() > 1 else p.kfra[0], blocks[name], f"{name} exact"
        )


def _kfra_reference(plain, lossfunc, x, target):
    """Botev et al.'s recursion written out for ``Linear -> act -> Linear -> act -> Linear``:
    ``B_3 = sum_n G_n`` (GGN w.r.t. the last pre-activation), ``B_l = (W^T B_{l+1} W) *
    mean_n d_n d_n^T`` with ``d_n = phi'(h_l,n)``; ``A_l = mean_n x_n x_n^T``."""
    from torch.func import hessian, jacrev

    lin = [plain[0], plain[2], plain[4]]
    h1 = lin[0](x)
    x2 = plain[1](h1)
    h2 = lin[1](x2)
    x3 = plain[3](h2)
    h3 = lin[2](x3)
    hl = hessian(lambda o: lossfunc(o, target))(h3.detach())
    n = h3.shape[0]
    b3 = sum(hl[i, :, i, :] for i in range(n))
    acts = [plain[1], plain[3]]

    def deriv(act, h):
        return torch.diagonal(jacrev(lambda u: act(u).sum(0))(h.detach()), dim1=0, dim2=2)

    d1, d2 = deriv(acts[0], h1), deriv(acts[1], h2)
    w2, w3 = lin[1].weight.detach(), lin[2].weight.detach()
    b2 = (w3.T @ b3 @ w3) * (d2.T @ d2 / n)
    b1 = (w2.T @ b2 @ w2) * (d1.T @ d1 / n)
    inputs = [x, x2.detach(), x3.detach()]
    return {
        f"{i}.weight": [b, inp.T @ inp / n] for i, b, inp in zip((0, 2, 4), (b1, b2, b3), inputs)
    } | {f"{i}.bias": [b] for i, b in zip((0, 2, 4), (b1, b2, b3))}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("loss_name", list(LOSSES))
@pytest.mark.parametrize("act", KFRA_ACTS + ["gelu"])
def test_kfra_recursion(act, loss_name, reduction, seed):
    plain = _mlp(act).to(DT)
    x = torch.randn(5, 4, dtype=DT)
    with torch.no_grad():
        target = _target(loss_name, plain(x))
    lossfunc = LOSSES[loss_name](reduction=reduction)
    expected = _kfra_reference(plain, lossfunc, x, target)
    model = extended_copy(plain)
    run_second_order(
        model, curvopt.extend(copy.deepcopy(lossfunc)), x, target, ext.KFRA(), ext.KFLR()
    )
    for name, p in trainable(model).items():
        assert len(p.kfra) == len(expected[name])
        for i, (a, b) in enumerate(zip(p.kfra, expected[name])):
            assert_close(a, b, f"{name}.kfra[{i}]")
    # the last layer's factors are KFLR's for any batch size; earlier ones differ from KFLR
    for a, b in zip(model[4].weight.kfra, model[4].weight.kflr):
        assert_close(a, b, "last layer")
    assert not torch.allclose(model[0].weight.kfra[0], model[0].weight.kflr[0])


KFRA_ERRORS = {
    "cnn": (
        lambda: nn.Sequential(
            OrderedDict(
                features=nn.Sequential(OrderedDict(conv=nn.Conv2d(3, 32, 3, padding=1))),
                act=nn.ReLU(),
                flat=nn.Flatten(),
                fc=nn.Linear(32 * 64 * 64, 3),
            )
        ),
        (3, 64, 64),
        "features.conv",
    ),
    "sequence": (
        lambda: nn.Sequential(
            OrderedDict(fc=nn.Linear(4, 3), flat=nn.Flatten(), out=nn.Linear(15, 3))
        ),
        (5, 4),
        "fc",
    ),
    "twice": (_Twice, (4,), "shared"),
    "softmax-between": (
        lambda: nn.Sequential(
            OrderedDict(fc1=nn.Linear(4, 5), sm=nn.Softmax(-1), fc2=nn.Linear(5, 3))
        ),
        (4,),
        "fc2",
    ),
    "layernorm": (
        lambda: nn.Sequential(
            OrderedDict(fc=nn.Linear(4, 5), ln=nn.LayerNorm(5), out=nn.Linear(5, 3))
        ),
        (4,),
        "ln",
    ),
}


@pytest.mark.parametrize("case", list(KFRA_ERRORS))
def test_kfra_unsupported_raises(case, seed):
    """A clear error naming the module, before any large matrix is formed (the CNN's dense
    ``(C H W)^2`` factor would be 128k x 128k, about 137 GB)."""
    make, shape, path = KFRA_ERRORS[case]
    model = extended_copy(make().to(DT))
    x = torch.randn(2, *shape, dtype=DT)
    loss = curvopt.extend(nn.CrossEntropyLoss())(model(x), torch.randint(0, 3, (2,)))
    with (
        pytest.raises(UnsupportedModuleError) as info,
        curvopt.collect(ext.KFRA(), ext.DiagGGNExact()),
    ):
        loss.backward()
    message = str(info.value)
    assert path in message and "KFRA" in message, message
    assert_no_attributes(model)


def test_combined_pass_equals_separate_passes(seed):
    plain = _mlp("sigmoid").to(DT)
    x = torch.randn(N, 4, dtype=DT)
    y = torch.randint(0, 3, (N,))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    model = extended_copy(plain)
    exts = {
        "diag_h": ext.DiagHessian,
        "diag_h_batch": ext.BatchDiagHessian,
        "diag_ggn_exact": ext.DiagGGNExact,
        "kfra": ext.KFRA,
        "kflr": ext.KFLR,
        "grad_batch": ext.BatchGrad,
    }
    separate = {}
    for attr, cls in exts.items():
        run_second_order(model, lossfunc, x, y, cls())
        separate.update(
            {(n, attr): copy.deepcopy(getattr(p, attr)) for n, p in trainable(model).items()}
        )
    run_second_order(model, lossfunc, x, y, *(cls() for cls in exts.values()))
    for (name, attr), value in separate.items():
        got = getattr(dict(model.named_parameters())[name], attr)
        for i, (a, b) in enumerate(
            zip(
                got if isinstance(got, list) else [got],
                value if isinstance(value, list) else [value],
            )
        ):
            assert_close(a, b, f"{name}.{attr}[{i}]")


@pytest.mark.parametrize("factor", [3.0, 0.5])
def test_scaled_loss_scales_hessian_and_kfra(factor, seed):
    plain = _mlp("tanh").to(DT)
    x = torch.randn(N, 4, dtype=DT)
    y = torch.randint(0, 3, (N,))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    model = extended_copy(plain)
    results = []
    for f in (1.0, factor):
        for p in model.parameters():
            p.__dict__.pop("diag_h", None)
            p.__dict__.pop("kfra", None)
        loss = f * lossfunc(model(x), y)
        with curvopt.collect(ext.DiagHessian(), ext.KFRA()):
            loss.backward()
        results.append(
            {
                n: (p.diag_h.clone(), [t.clone() for t in p.kfra])
                for n, p in trainable(model).items()
            }
        )
    for name in results[0]:
        (h1, k1), (h2, k2) = results[0][name], results[1][name]
        assert_close(h2, factor * h1, f"{name}.diag_h")
        assert_close(k2[0], factor * k1[0], f"{name}.kfra B")
        if len(k1) == 2:
            assert_close(k2[1], k1[1], f"{name}.kfra A")
