"""Monte-Carlo curvature (``DiagGGNMC``, ``BatchDiagGGNMC``, ``KFAC``): unbiased for the exact
quantities, reproducible under ``torch.manual_seed``, consistent within one pass.

Unbiasedness is checked with tolerances derived from the estimator's standard error over
independent passes (``conftest.assert_unbiased``), tight enough that a 10 % bias fails.
"""

import copy

import pytest
import torch
from conftest import DT, assert_close, assert_unbiased, extended_copy, run_second_order, trainable
from torch import nn

import curvopt
from curvopt import extensions as ext

N = 4


def _mlp():
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DT)


def _seq():
    """Sequence model with ``[N, C, T]`` logits (CE over positions) or ``[N, C, T]`` outputs."""

    class Seq(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(3, 4)
            self.fc2 = nn.Linear(4, 3)

        def forward(self, x):
            return self.fc2(torch.sigmoid(self.fc1(x))).transpose(1, 2)

    return Seq().to(DT)


def _cnn():
    return nn.Sequential(nn.Conv1d(2, 3, 3, padding=1), nn.ReLU(), nn.Conv1d(3, 3, 2)).to(DT)


MODELS = {
    "mlp": (_mlp, (4,)),
    "seq": (_seq, (5, 3)),
    "cnn": (_cnn, (2, 5)),
}

LOSSES = {
    "ce": nn.CrossEntropyLoss,
    "mse": nn.MSELoss,
    "bce": nn.BCEWithLogitsLoss,
}


def _problem(model_name, loss_name, reduction="mean"):
    make, shape = MODELS[model_name]
    model = extended_copy(make())
    x = torch.randn(N, *shape, dtype=DT)
    with torch.no_grad():
        out = model(x)
    if loss_name == "ce":
        target = torch.randint(0, out.shape[1], (out.shape[0], *out.shape[2:]))
    elif loss_name == "mse":
        target = torch.randn_like(out)
    else:
        target = torch.rand_like(out)
    lossfunc = curvopt.extend(LOSSES[loss_name](reduction=reduction))
    return model, lossfunc, x, target


def _snapshot(model, attrs):
    return {
        (name, a): copy.deepcopy(getattr(p, a))
        for name, p in trainable(model).items()
        for a in attrs
    }


def _rel_err(approx, exact):
    return ((approx - exact).norm() / exact.norm()).item()


PASSES = 10


def _check_unbiased(model_name, loss_name, reduction, mc_samples):
    """``PASSES`` independent passes of every MC quantity have the exact quantity as mean, within
    tolerances from their standard error (:func:`conftest.assert_unbiased`: a 10 % bias fails)."""
    model, lossfunc, x, target = _problem(model_name, loss_name, reduction)
    approx = "expand" if model_name != "seq" else "reduce"
    run_second_order(
        model, lossfunc, x, target,
        ext.DiagGGNExact(), ext.BatchDiagGGNExact(), ext.KFLR(kfac_approx=approx),
    )
    exact = _snapshot(model, ["diag_ggn_exact", "diag_ggn_exact_batch", "kflr"])
    draws = []
    for s in range(PASSES):
        torch.manual_seed(s)
        run_second_order(
            model, lossfunc, x, target,
            ext.DiagGGNMC(mc_samples=mc_samples), ext.BatchDiagGGNMC(mc_samples=mc_samples),
            ext.KFAC(mc_samples=mc_samples, kfac_approx=approx),
        )
        draws.append(_snapshot(model, ["diag_ggn_mc", "diag_ggn_mc_batch", "kfac"]))
    for name in trainable(model):
        for attr, reference in (("diag_ggn_mc", "diag_ggn_exact"),
                                ("diag_ggn_mc_batch", "diag_ggn_exact_batch")):
            samples = torch.stack([d[name, attr] for d in draws])
            assert_unbiased(samples, exact[name, reference], f"{name}.{attr}")
        kflr = exact[name, "kflr"]
        assert all(len(d[name, "kfac"]) == len(kflr) for d in draws)
        samples = torch.stack([d[name, "kfac"][0] for d in draws])
        assert_unbiased(samples, kflr[0], f"{name}.kfac B")
        if len(kflr) == 2:  # the input-side factor does not depend on the samples
            assert_close(draws[0][name, "kfac"][1], kflr[1], f"{name}.kfac A")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("loss_name", list(LOSSES))
@pytest.mark.parametrize("model_name", list(MODELS))
def test_mc_unbiased(model_name, loss_name, reduction, seed):
    _check_unbiased(model_name, loss_name, reduction, mc_samples=1000)


def test_mc_average_of_single_samples_is_unbiased(seed):
    """Averaging many independent ``mc_samples=1`` passes also converges (no per-pass bias)."""
    model, lossfunc, x, target = _problem("mlp", "ce")
    run_second_order(model, lossfunc, x, target, ext.DiagGGNExact())
    exact = _snapshot(model, ["diag_ggn_exact"])
    total = {name: 0 for name in trainable(model)}
    passes = 400
    for _ in range(passes):
        run_second_order(model, lossfunc, x, target, ext.DiagGGNMC())
        for name, p in trainable(model).items():
            total[name] = total[name] + p.diag_ggn_mc
    for name, value in total.items():
        err = _rel_err(value / passes, exact[name, "diag_ggn_exact"])
        assert err < 0.25, f"{name}: relative error {err:.3g}"


# ------------------------------------------------------------------------------ randomness

MC_EXTS = {
    "diag": lambda: [ext.DiagGGNMC(mc_samples=2)],
    "batch": lambda: [ext.BatchDiagGGNMC(mc_samples=2)],
    "kfac": lambda: [ext.KFAC(mc_samples=2)],
    "all": lambda: [
        ext.DiagGGNMC(mc_samples=2), ext.BatchDiagGGNMC(mc_samples=2), ext.KFAC(mc_samples=2)
    ],
}
_ATTRS = {ext.DiagGGNMC: "diag_ggn_mc", ext.BatchDiagGGNMC: "diag_ggn_mc_batch", ext.KFAC: "kfac"}


def _flat(value):
    return torch.cat([v.flatten() for v in value]) if isinstance(value, list) else value.flatten()


@pytest.mark.parametrize("loss_name", list(LOSSES))
@pytest.mark.parametrize("which", list(MC_EXTS))
def test_reproducible_under_manual_seed(which, loss_name, seed):
    model, lossfunc, x, target = _problem("mlp", loss_name)
    attrs = [_ATTRS[type(e)] for e in MC_EXTS[which]()]
    results = []
    for s in (7, 7, 8):
        torch.manual_seed(s)
        run_second_order(model, lossfunc, x, target, *MC_EXTS[which]())
        results.append(_snapshot(model, attrs))
    for key in results[0]:
        a, b, c = (_flat(r[key]) for r in results)
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{key}: same seed, different result")
        assert not torch.equal(a, c), f"{key}: different seeds, identical result"


@pytest.mark.parametrize("loss_name", list(LOSSES))
@pytest.mark.parametrize("model_name", list(MODELS))
def test_batch_mc_sums_to_mc_in_one_pass(model_name, loss_name, seed):
    model, lossfunc, x, target = _problem(model_name, loss_name)
    run_second_order(
        model, lossfunc, x, target, ext.DiagGGNMC(mc_samples=3), ext.BatchDiagGGNMC(mc_samples=3)
    )
    for name, p in trainable(model).items():
        assert p.diag_ggn_mc_batch.shape == (N, *p.shape)
        assert_close(p.diag_ggn_mc_batch.sum(0), p.diag_ggn_mc, name)
        assert (p.diag_ggn_mc_batch >= 0).all()


def test_mc_differs_from_exact_with_few_samples(seed):
    """The MC quantities are really sampled (not the exact ones under another name)."""
    model, lossfunc, x, target = _problem("mlp", "ce")
    run_second_order(model, lossfunc, x, target, ext.DiagGGNExact(), ext.KFLR())
    exact = _snapshot(model, ["diag_ggn_exact", "kflr"])
    run_second_order(model, lossfunc, x, target, ext.DiagGGNMC(), ext.KFAC())
    for name, p in trainable(model).items():
        assert p.diag_ggn_mc.shape == p.shape
        assert not torch.allclose(p.diag_ggn_mc, exact[name, "diag_ggn_exact"])
        assert not torch.allclose(p.kfac[0], exact[name, "kflr"][0])
        # one sample per data point: the B factor has rank <= N (MC) instead of <= N * C
        assert torch.linalg.matrix_rank(p.kfac[0]) <= N


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_invalid_mc_samples(bad):
    for cls in (ext.DiagGGNMC, ext.BatchDiagGGNMC, ext.KFAC):
        with pytest.raises(ValueError, match="mc_samples"):
            cls(mc_samples=bad)
