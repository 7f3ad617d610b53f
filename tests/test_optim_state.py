"""Optimizer state round-trips through ``torch.save`` / ``torch.load(weights_only=True)``.

For every optimizer and every cached inverse form (Cholesky factors, Woodbury
``LowRankInverse``, eigendecompositions), with damping strategies and momentum: a run resumed
from the loaded state continues the same trajectory, reusing the loaded inverses.
"""

import io

import pytest
import torch
from torch import nn

import curvopt
from curvopt.optim import KFAC, DiagGGNNewton, LevenbergMarquardt, LowRankInverse
from curvopt.optim import VarianceAdaptedSGD

DT = torch.float64
REUSE = {"curvature_interval": 2, "inverse_interval": 2}  # step 2 uses the loaded inverses

MAKERS = {
    "cholesky": lambda ps: KFAC(
        ps, lr=0.2, damping=1e-2, curvature="kflr", momentum=0.5, curvature_ema=0.5, **REUSE
    ),
    "woodbury": lambda ps: KFAC(ps, lr=0.2, damping=1e-2, weight_decay=1e-3, **REUSE),
    "eigh": lambda ps: KFAC(ps, lr=0.2, damping=1e-2, kronecker_damping="exact", **REUSE),
    "levenberg_marquardt": lambda ps: KFAC(
        ps, lr=0.2, damping=LevenbergMarquardt(1e-2, interval=1), curvature="kflr"
    ),
    "diag": lambda ps: DiagGGNNewton(
        ps, lr=0.2, damping=LevenbergMarquardt(1e-2, interval=1), momentum=0.9
    ),
    "variance": lambda ps: VarianceAdaptedSGD(ps, lr=0.2, momentum=0.9),
}
#: the state entry that holds each form's cached inverse
CACHED = {"cholesky": "inverse", "woodbury": "inverse", "eigh": "eigh"}


def _problem(seed=0):
    torch.manual_seed(seed)
    model = curvopt.extend(nn.Sequential(nn.Linear(40, 6), nn.Tanh(), nn.Linear(6, 3)).to(DT))
    return model, curvopt.extend(nn.CrossEntropyLoss())


def _closure(opt, model, lossfunc, step):
    """A batch of 8 < width 40 (so ``A`` is low-rank, and Woodbury its cheaper inverse), different
    at every step."""
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(8, 40, dtype=DT, generator=generator)
    y = torch.randint(0, 3, (8,), generator=generator)

    def closure():
        opt.zero_grad()
        torch.manual_seed(step)
        loss = lossfunc(model(x), y)
        loss.backward()
        return loss

    return closure


@pytest.mark.parametrize("form", list(MAKERS))
def test_state_dict_round_trips_with_weights_only(form):
    model, lossfunc = _problem()
    opt = MAKERS[form](model.parameters())
    for step in range(3):
        opt.step(_closure(opt, model, lossfunc, step))
    if form in CACHED:
        values = [s[CACHED[form]]["value"] for s in opt.state.values()]
        woodbury = any(isinstance(v, LowRankInverse) for value in values for v in value)
        assert woodbury == (form == "woodbury")
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    saved = [p.detach().clone() for p in model.parameters()]
    for step in range(3, 6):
        opt.step(_closure(opt, model, lossfunc, step))
    expected = [p.detach().clone() for p in model.parameters()]

    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    resumed, lossfunc = _problem(seed=1)
    with torch.no_grad():
        for p, value in zip(resumed.parameters(), saved):
            p.copy_(value)
    opt2 = MAKERS[form](resumed.parameters())
    opt2.load_state_dict(loaded)
    for step in range(3, 6):
        opt2.step(_closure(opt2, resumed, lossfunc, step))
    for p, e in zip(resumed.parameters(), expected):
        torch.testing.assert_close(p.detach(), e, rtol=0, atol=1e-12)
