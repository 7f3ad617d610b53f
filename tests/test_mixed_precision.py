"""Mixed precision: CPU ``autocast`` (bf16, fp16) with the backward pass outside it (PyTorch's
recipe) or inside it, and models cast to bf16/fp16, against float64 ``torch.func`` references
of the same parameters.

Convention (docs): every quantity has the parameter's dtype, like ``p.grad``. Under autocast
(float32 parameters) each layer's operands are taken as the layer multiplied them (rounded to
the autocast dtype) and the quantity is computed and accumulated in float32; a bf16/fp16 model
gets bf16/fp16 quantities. The errors are then those of the low-precision forward and
backward pass itself: a few units of the low dtype's roundoff, relative to the quantity's size.
"""

import copy

import pytest
import reference
import torch
from conftest import trainable
from torch import nn

import curvopt
from curvopt import extensions as ext

N = 6
LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: relative error (Frobenius, against the float64 reference) allowed per low dtype: the
#: forward and backward passes round every activation and gradient to it
TOL = {torch.bfloat16: 4e-2, torch.float16: 1e-2}


def mlp():
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 6), nn.Sigmoid(), nn.Linear(6, 3))


def cnn():
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(3, 2, 2, stride=2),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(8, 3),
    )


def norms():
    """LayerNorm runs in float32 under CPU autocast, between bf16 Linear layers."""
    return nn.Sequential(nn.Linear(5, 6), nn.LayerNorm(6), nn.ReLU(), nn.Linear(6, 3))


class Attention(nn.Module):
    """Embedding (float32 under autocast) -> attention (the generic ``vmap`` rule) ->
    GroupNorm -> Linear, with K-dim cross-entropy over the positions."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.mha = nn.MultiheadAttention(4, 2, batch_first=True)
        self.gn = nn.GroupNorm(2, 4)
        self.out = nn.Linear(4, 3)

    def forward(self, tokens):
        h = self.emb(tokens)
        h = self.mha(h, h, h, need_weights=False)[0]
        h = self.gn(h.transpose(1, 2)).transpose(1, 2)
        return self.out(h).transpose(1, 2)  # [N, C, T]


MODELS = {
    "mlp": (mlp, (5,)),
    "cnn": (cnn, (2, 4, 4)),
    "norms": (norms, (5,)),
    "attention": (Attention, "tokens"),
}
#: no Kronecker factors for attention's weights, no Hessian for GroupNorm and softmax
FIRST_ORDER_AND_GGN = (
    "BatchGrad",
    "BatchL2Grad",
    "SumGradSquared",
    "Variance",
    "DiagGGNExact",
    "BatchDiagGGNExact",
)

EXACT = {
    "BatchGrad": ext.BatchGrad,
    "BatchL2Grad": ext.BatchL2Grad,
    "SumGradSquared": ext.SumGradSquared,
    "Variance": ext.Variance,
    "DiagGGNExact": ext.DiagGGNExact,
    "BatchDiagGGNExact": ext.BatchDiagGGNExact,
    "KFLR": ext.KFLR,
}
CURVED = {"DiagHessian": ext.DiagHessian, "BatchDiagHessian": ext.BatchDiagHessian}
SAMPLED = {"DiagGGNMC": ext.DiagGGNMC, "KFAC": ext.KFAC, "BatchDiagGGNMC": ext.BatchDiagGGNMC}


def _references(plain, X, y):
    """``name -> {attr: float64 value}`` for every exact quantity."""
    lossfunc = nn.CrossEntropyLoss()
    refs = {k: dict(v) for k, v in reference.first_order(plain, lossfunc, X, y).items()}
    blocks, per_sample = reference.ggn(plain, lossfunc, X, y)
    names = dict(plain.named_modules())
    kron = reference.kronecker(plain, lossfunc, X, y)
    for name, p in trainable(plain).items():
        refs[name]["diag_ggn_exact"] = torch.diagonal(blocks[name]).reshape(p.shape)
        refs[name]["diag_ggn_exact_batch"] = per_sample[name]
        module_name, kind = name.rsplit(".", 1)
        module = names[module_name]
        if module_name in kron and isinstance(module, (nn.Linear, nn.Conv2d)):
            b, a = kron[module_name]
            if kind == "weight":
                refs[name]["kflr"] = [b, a]
            elif isinstance(module, nn.Linear):  # one position: the bias block is B
                refs[name]["kflr"] = [b]
    smooth = not any(isinstance(m, (nn.ReLU, nn.GroupNorm)) for m in plain.modules())
    if smooth:  # the Hessian reference
        diag, per_sample = reference.hessian(plain, lossfunc, X, y)  # needs smooth ops
        for name in diag:
            refs[name]["diag_h"] = diag[name]
            refs[name]["diag_h_batch"] = per_sample[name]
    return refs


def _assert_near(actual, expected, tol, what):
    if isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected), what
        for i, (a, e) in enumerate(zip(actual, expected)):
            _assert_near(a, e, tol, f"{what}[{i}]")
        return
    assert actual.shape == expected.shape, what
    error = (actual.double() - expected).norm() / expected.norm()
    assert float(error) <= tol, f"{what}: relative error {float(error):.2e} > {tol}"


def _run(model, X, y, extension, mode, dtype):
    """Forward (and backward, for ``mode`` "inside") under CPU autocast, or plain ("model")."""
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    model.zero_grad()
    if mode == "model":
        with curvopt.collect(extension):
            lossfunc(model(X), y).backward()
        return
    with torch.autocast("cpu", dtype=dtype):
        loss = lossfunc(model(X), y)
        if mode == "inside":
            with curvopt.collect(extension):
                loss.backward()
    if mode == "outside":
        with curvopt.collect(extension):
            loss.backward()


def _setup(model_name, mode, dtype):
    torch.manual_seed(0)
    make, shape = MODELS[model_name]
    model = make()
    if shape == "tokens":
        X, y = torch.randint(0, 7, (N, 3)), torch.randint(0, 3, (N, 3))
    else:
        X, y = torch.randn(N, *shape), torch.randint(0, 3, (N,))
    if mode == "model":
        model = model.to(dtype)
        X = X.to(dtype) if X.is_floating_point() else X
    plain = copy.deepcopy(model).double()
    return curvopt.extend(model), plain, X, y


@pytest.mark.parametrize("low", list(LOW))
@pytest.mark.parametrize("mode", ["outside", "inside", "model"])
@pytest.mark.parametrize("model_name", list(MODELS))
def test_exact_quantities_match_float64(model_name, mode, low):
    dtype = LOW[low]
    model, plain, X, y = _setup(model_name, mode, dtype)
    refs = _references(plain, X.double() if X.is_floating_point() else X, y)
    tol = TOL[dtype]
    extensions = dict(EXACT, **CURVED) if "diag_h" in next(iter(refs.values())) else EXACT
    if model_name == "attention":
        extensions = {k: EXACT[k] for k in FIRST_ORDER_AND_GGN}
    for ext_name, make in extensions.items():
        extension = make()
        _run(model, X, y, extension, mode, dtype)
        for name, p in trainable(model).items():
            value = getattr(p, extension.attr)
            if extension.attr not in refs[name]:
                continue  # no Kronecker reference for this parameter
            for v in value if isinstance(value, list) else [value]:
                assert v.dtype == p.dtype, f"{ext_name} {name}: {v.dtype} != {p.dtype}"
            expected = refs[name][extension.attr]
            if extension.attr == "variance":  # a difference of moments: relative to them
                scale = refs[name]["sum_grad_squared"] / N
                error = (value.double() - expected).norm() / scale.norm()
                assert float(error) <= tol, f"variance {name}: {float(error):.2e}"
            else:
                _assert_near(value, expected, tol, f"{ext_name} {name} ({mode}, {low})")
            if extension.attr in ("grad_batch",):
                assert torch.allclose(value.sum(0), p.grad, rtol=0, atol=tol * p.grad.abs().max())


@pytest.mark.parametrize("mode", ["outside", "inside", "model"])
def test_sampled_and_kfra_quantities_have_the_parameter_dtype(mode):
    """Monte-Carlo draws differ between dtypes; they are finite, in the parameter's dtype, and
    their mean over many draws matches the exact diagonal; KFRA as the float64 recursion."""
    dtype = torch.bfloat16
    model, plain, X, y = _setup("mlp", mode, dtype)
    torch.manual_seed(1)
    _run(model, X, y, ext.DiagGGNMC(mc_samples=2000), mode, dtype)
    mc = {name: p.diag_ggn_mc.clone() for name, p in trainable(model).items()}
    _run(model, X, y, ext.DiagGGNExact(), mode, dtype)
    for name, p in trainable(model).items():
        assert mc[name].dtype == p.dtype
        _assert_near(mc[name], p.diag_ggn_exact.double(), 0.15, f"diag_ggn_mc {name}")
    for make in SAMPLED.values():
        extension = make()
        _run(model, X, y, extension, mode, dtype)
        for p in trainable(model).values():
            value = getattr(p, extension.attr)
            for v in value if isinstance(value, list) else [value]:
                assert v.dtype == p.dtype and bool(torch.isfinite(v).all())
    _run(model, X, y, ext.KFRA(), mode, dtype)
    expected = reference.kfra_mlp(plain, nn.CrossEntropyLoss(), X.double(), y)
    linears = [m for m in model if isinstance(m, nn.Linear)]
    for layer, b in zip(linears, expected):
        assert layer.weight.kfra[0].dtype == layer.weight.dtype
        _assert_near(layer.weight.kfra[0], b, TOL[dtype], "kfra B")


OPTIMIZERS = {
    "KFAC": lambda ps: curvopt.optim.KFAC(ps, lr=0.1, damping=0.1),
    "DiagGGNNewton": lambda ps: curvopt.optim.DiagGGNNewton(ps, lr=0.1, damping=0.1),
    "VarianceAdaptedSGD": lambda ps: curvopt.optim.VarianceAdaptedSGD(ps, lr=0.1),
}


@pytest.mark.parametrize("mode", ["outside", "inside"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_step_under_autocast_matches_float32(name, mode):
    """The curvature arrives in float32, so the optimizers factorise in float32 and take the
    float32 step up to the rounding of the bf16 forward and backward pass."""
    steps = []
    for use_autocast in (False, True):
        model, _, X, y = _setup("mlp", mode, torch.bfloat16)
        lossfunc = curvopt.extend(nn.CrossEntropyLoss())
        opt = OPTIMIZERS[name](model.parameters())
        before = [p.detach().clone() for p in model.parameters()]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_autocast):
            loss = lossfunc(model(X), y)
            if mode == "inside":
                with opt.collect():
                    loss.backward()
        if mode == "outside":
            with opt.collect():
                loss.backward()
        opt.step()
        steps.append(
            torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)])
        )
    reference, mixed = steps
    assert float((mixed - reference).norm() / reference.norm()) <= TOL[torch.bfloat16]
