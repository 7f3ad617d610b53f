"""Engine quantities on float32 models (issue 14 item 12): every attribute has the parameter's
dtype and matches the float64 torch.func reference within float32 precision; the optimizers
step float32 models.

Tolerance: ``rtol = 1e-4`` and ``atol = 1e-5 · max |reference|`` (float32 has ``eps ≈ 1.2e-7``;
these tiny models accumulate a few hundred roundings at most), far below any formula error.
"""

from __future__ import annotations

import copy

import pytest
import reference
import torch
from conftest import trainable
from torch import nn

import curvopt
from curvopt import extensions as ext
from fixtures import zoo

N = 3
MODELS = ["mlp", "resnet_block"]

EXACT = {
    "grad_batch": ext.BatchGrad,
    "batch_l2": ext.BatchL2Grad,
    "sum_grad_squared": ext.SumGradSquared,
    "variance": ext.Variance,
    "diag_ggn_exact": ext.DiagGGNExact,
    "diag_ggn_exact_batch": ext.BatchDiagGGNExact,
    "diag_h": ext.DiagHessian,
    "diag_h_batch": ext.BatchDiagHessian,
    "kflr": ext.KFLR,
}


def _assert_close32(actual, expected, what):
    assert actual.dtype == torch.float32, f"{what}: dtype {actual.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    atol = 1e-5 * expected.abs().max().item() + 1e-12
    torch.testing.assert_close(
        actual.double(), expected, rtol=1e-4, atol=atol, msg=lambda m: f"{what}: {m}"
    )


def _expected(attr, problem, X, y):
    """``param name -> float64 reference`` of ``attr``."""
    args = (problem.model, problem.loss_on, X, y, problem.batch_dim)
    if attr in ("grad_batch", "batch_l2", "sum_grad_squared", "variance"):
        return {k: v[attr] for k, v in reference.first_order(*args).items()}
    if attr.startswith("diag_ggn"):
        blocks, per_sample = reference.ggn(*args)
        if attr.endswith("batch"):
            return per_sample
        return {k: torch.diagonal(b).reshape(per_sample[k].shape[1:]) for k, b in blocks.items()}
    if attr.startswith("diag_h"):
        diag, per_sample = reference.hessian(*args)
        return per_sample if attr.endswith("batch") else diag
    blocks, _ = reference.ggn(*args)
    layers = reference.kronecker(*args, "expand")
    expected = {f"{k}.weight": [b, a] for k, (b, a) in layers.items()}
    expected.update({k: [blocks[k]] for k, p in trainable(problem.model).items() if p.dim() == 1})
    return expected


@pytest.mark.parametrize("attr", list(EXACT))
@pytest.mark.parametrize("name", MODELS)
def test_float32_matches_float64_reference(name, attr):
    problem = zoo.ZOO[name]("mean")
    X, y = problem.make_batch(N, 0)
    model = curvopt.extend(copy.deepcopy(problem.model).float())
    lossfunc = curvopt.extend(copy.deepcopy(problem.lossfunc))
    X32 = X.float() if X.is_floating_point() else X
    loss = problem.loss_of(model, X32, y, lossfunc)
    with curvopt.collect(EXACT[attr]()):
        loss.backward()
    expected = _expected(attr, problem, X, y)
    for pname, p in trainable(model).items():
        value = getattr(p, attr)
        if isinstance(value, list):
            assert len(value) == len(expected[pname]), f"{pname}.{attr}: factor count"
            for i, (v, e) in enumerate(zip(value, expected[pname])):
                _assert_close32(v, e, f"{name} {pname}.{attr}[{i}]")
        else:
            _assert_close32(value, expected[pname], f"{name} {pname}.{attr}")


def _mlp32():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def test_float32_kfra_and_monte_carlo_dtypes(seed):
    """KFRA and the MC quantities (checked for unbiasedness in float64 elsewhere) keep float32."""
    model = curvopt.extend(_mlp32())
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    exts = (ext.KFRA(), ext.DiagGGNMC(), ext.BatchDiagGGNMC(), ext.KFAC())
    with curvopt.collect(*exts):
        lossfunc(model(x), y).backward()
    for pname, p in model.named_parameters():
        for attr in ("kfra", "diag_ggn_mc", "diag_ggn_mc_batch", "kfac"):
            value = getattr(p, attr)
            for v in value if isinstance(value, list) else [value]:
                assert v.dtype == torch.float32, f"{pname}.{attr}: {v.dtype}"
                assert v.isfinite().all(), f"{pname}.{attr}"
        torch.testing.assert_close(p.diag_ggn_mc_batch.sum(0), p.diag_ggn_mc)


OPTIMIZERS = {
    "kfac": lambda p: curvopt.optim.KFAC(p, lr=0.1, damping=0.01),
    "kflr": lambda p: curvopt.optim.KFAC(p, lr=0.1, damping=0.01, curvature="kflr"),
    "kfra": lambda p: curvopt.optim.KFAC(p, lr=0.1, damping=0.01, curvature="kfra"),
    "kflr-exact": lambda p: curvopt.optim.KFAC(
        p, lr=0.1, damping=0.01, curvature="kflr", kronecker_damping="exact"
    ),
    "diag-mc": lambda p: curvopt.optim.DiagGGNNewton(p, lr=0.1, damping=0.01),
    "diag-exact": lambda p: curvopt.optim.DiagGGNNewton(p, lr=0.1, damping=0.01, curvature="exact"),
    "vsgd": lambda p: curvopt.optim.VarianceAdaptedSGD(p, lr=0.1),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizers_step_float32_models(name, seed):
    """Steps on a float32 model keep float32 parameters and state, and lower the loss."""
    model = curvopt.extend(_mlp32())
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    opt = OPTIMIZERS[name](model.parameters())
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = lossfunc(model(x), y)
        with opt.collect():
            loss.backward()
        opt.step()
        losses.append(loss.item())
    for p in model.parameters():
        assert p.dtype == torch.float32 and p.isfinite().all()
        for value in opt.state[p].values():
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                assert value.dtype == torch.float32, f"{name} state dtype {value.dtype}"
    assert losses[-1] < losses[0], f"{name}: losses {losses}"
