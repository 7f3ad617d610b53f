"""Every optimizer and preset takes the steps it took when ``tests/data/optim_steps.pt`` was
recorded (re-recorded after the cached inverses and the compressed Woodbury basis, which moved three
cases by rounding: 1e-16 in float64, 6e-8 in float32; after the factored step of dense layers,
which moved the float32 case by 6e-8; on an Intel Xeon, whose BLAS rounds 16 cases
differently from the AMD EPYC that recorded them before, by at most 1.1e-16; and on another Xeon
of the same model name, whose BLAS rounds two cases differently, by 3e-8 in float32 and 3e-17:
the machine is named by the processor's family, model and stepping too, and the file holds the
steps of the code before that change, which the code after it takes bit for bit).

Each case trains a small model for a few steps on changing batches and keeps the parameters
after every step. On the machine (torch build, CPU capability and model) that recorded the file
the comparison is exact (``torch.equal``: bit-identical steps); elsewhere (another BLAS, another
CPU) it is a float64 comparison to 1e-10. Re-record (only when a change of the numbers is
intended) with ``python tests/test_optim_steps_recorded.py --record``.
"""

from __future__ import annotations

import pathlib
import platform
import sys
import warnings

import pytest
import torch
from torch import nn

import curvopt
from curvopt.optim import EKFAC, KFAC, DiagGGNNewton, LevenbergMarquardt, VarianceAdaptedSGD

RECORD = pathlib.Path(__file__).resolve().parent / "data" / "optim_steps.pt"
STEPS = 5
N = 6
PRACTICAL = {"curvature_interval": 2, "curvature_ema": 0.95, "momentum": 0.9, "kl_clip": 1e-3}


def _mlp(width_in: int, dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width_in, 7), nn.Tanh(), nn.Linear(7, 3)).to(dtype)


class _WithToken(nn.Module):
    """An MLP with a raw parameter (no Kronecker factors): KFAC's ``fallback``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.rnn = nn.RNN(2, 5, batch_first=True)
        self.head = nn.Linear(5, 3).double()
        self.rnn.double()

    def forward(self, x):
        return self.head(self.rnn(x.reshape(x.shape[0], 2, 2))[0][:, -1])


#: name -> (model maker, optimizer maker, loss reduction, step with a closure)
CASES = {
    "diag_mc": (
        lambda: _mlp(4, torch.float64),
        lambda p: DiagGGNNewton(p, 0.3, 0.1, kl_clip=None),
        "mean",
        0,
    ),
    "diag_exact_all_options": (
        lambda: _mlp(4, torch.float64),
        lambda p: DiagGGNNewton(p, 0.3, 0.1, "exact", 0.01, **PRACTICAL),
        "mean",
        0,
    ),
    "diag_levenberg_marquardt": (
        lambda: _mlp(4, torch.float64),
        lambda p: DiagGGNNewton(
            p, 0.5, LevenbergMarquardt(0.1, interval=1), "exact", 0.01, kl_clip=None
        ),
        "mean",
        1,
    ),
    "diag_fallback_sgd": (
        lambda: _mlp(4, torch.float64),
        lambda p: DiagGGNNewton(p, 0.3, 0.1, mc_samples=2, fallback="sgd", kl_clip=None),
        "sum",
        0,
    ),
    "kfac_paper": (
        lambda: _mlp(4, torch.float64),
        lambda p: KFAC(p, 0.3, 0.1, kl_clip=None),
        "mean",
        0,
    ),
    "kfac_practical": (
        lambda: _mlp(4, torch.float64),
        lambda p: KFAC(p, 0.3, 0.1, inverse_interval=2, **PRACTICAL),
        "mean",
        0,
    ),
    "kflr_exact_damping": (
        lambda: _mlp(4, torch.float64),
        lambda p: KFAC(
            p, 0.3, 0.1, "kflr", 0.01, kronecker_damping="exact", inverse_interval=2, kl_clip=None
        ),
        "sum",
        0,
    ),
    "kfra_momentum": (
        lambda: _mlp(4, torch.float64),
        lambda p: KFAC(p, 0.3, 0.1, "kfra", momentum=0.5, curvature_ema=0.5, kl_clip=None),
        "mean",
        0,
    ),
    "kfac_low_rank_float32": (  # input width 24 > batch 6: Woodbury inverses
        lambda: _mlp(24, torch.float32),
        lambda p: KFAC(p, 0.3, 0.1, "kflr", curvature_ema=0.9, kl_clip=1e-2),
        "mean",
        0,
    ),
    "kfac_levenberg_marquardt": (
        lambda: _mlp(4, torch.float64),
        lambda p: KFAC(p, 0.5, LevenbergMarquardt(0.1, interval=2), "kflr", 0.01, kl_clip=None),
        "mean",
        1,
    ),
    "kfac_fallback_diagonal": (
        _WithToken,
        lambda p: KFAC(
            p, 0.2, 0.1, "kflr", fallback="diagonal", curvature_interval=2, kl_clip=None
        ),
        "mean",
        0,
    ),
    "kfac_param_groups": (
        lambda: _mlp(4, torch.float64),
        lambda p: KFAC(
            [{"params": p[:2], "lr": 0.1, "momentum": 0.9}, {"params": p[2:]}],
            0.3,
            0.1,
            "kflr",
            kl_clip=None,
        ),
        "mean",
        0,
    ),
    "ekfac_paper": (
        lambda: _mlp(4, torch.float64),
        lambda p: EKFAC(p, 0.3, 0.1, kl_clip=None, basis_source="current"),
        "mean",
        0,
    ),
    "ekfac_practical": (
        lambda: _mlp(4, torch.float64),
        lambda p: EKFAC(
            p,
            0.3,
            0.1,
            "kflr",
            0.01,
            reduction="sum",
            basis_interval=2,
            momentum=0.9,
            kl_clip=1e-3,
            basis_source="current",
        ),
        "sum",
        0,
    ),
    "variance_sgd": (
        lambda: _mlp(4, torch.float64),
        lambda p: VarianceAdaptedSGD(p, 0.3, weight_decay=0.01),
        "mean",
        0,
    ),
    "variance_msvag": (
        lambda: _mlp(4, torch.float64),
        lambda p: VarianceAdaptedSGD(p, 0.3, momentum=0.9),
        "mean",
        1,
    ),
}


def trajectory(name: str) -> torch.Tensor:
    """The parameters (flattened, float64) after each of ``STEPS`` steps of case ``name``."""
    make_model, make_opt, reduction, use_closure = CASES[name]
    model = curvopt.extend(make_model())
    dtype = next(model.parameters()).dtype
    width = 4 if isinstance(model, _WithToken) else model[0].in_features
    lossfunc = curvopt.extend(nn.CrossEntropyLoss(reduction=reduction))
    opt = make_opt(list(model.parameters()))
    generator = torch.Generator().manual_seed(1)
    torch.manual_seed(2)  # Monte-Carlo curvature draws from the global generator
    rows = []
    for _ in range(STEPS):
        X = torch.randn(N, width, generator=generator, dtype=dtype)
        y = torch.randint(0, 3, (N,), generator=generator)
        if use_closure:

            def closure(X=X, y=y):
                opt.zero_grad()
                loss = lossfunc(model(X), y)
                loss.backward()
                return loss

            opt.step(closure)
        else:
            opt.zero_grad()
            loss = lossfunc(model(X), y)
            with opt.collect():
                loss.backward()
            opt.step()
        rows.append(torch.cat([p.detach().reshape(-1).double() for p in model.parameters()]))
    return torch.stack(rows)


def _cpu_model() -> str:
    """The processor's model name, family, model and stepping (the same torch build rounds
    differently on other CPUs, also on two sold under one model name)."""
    cpuinfo = pathlib.Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return platform.processor()
    fields = {}
    for line in cpuinfo.read_text().splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    numbers = ", ".join(f"{k} {fields.get(k, '?')}" for k in ("cpu family", "model", "stepping"))
    return f"{fields.get('model name', platform.processor())} ({numbers})"


def _machine() -> str:
    return f"{torch.__version__} {torch.backends.cpu.get_cpu_capability()} {_cpu_model()}"


def _run(name: str) -> torch.Tensor:
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the RNN's fallback warns that it has no factors
        return trajectory(name)


@pytest.mark.parametrize("name", sorted(CASES))
def test_steps_equal_the_recorded_ones(name):
    recorded = torch.load(RECORD, weights_only=True)
    steps = _run(name)
    assert not torch.equal(steps[0], steps[-1]), "the case must move the parameters"
    if recorded["machine"] == _machine():
        difference = (steps - recorded["steps"][name]).abs().max()
        assert torch.equal(steps, recorded["steps"][name]), f"not bit-identical: {difference}"
    else:
        tol = 1e-5 if "float32" in name else 1e-10
        torch.testing.assert_close(steps, recorded["steps"][name], rtol=tol, atol=tol)


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    torch.set_num_threads(1)
    RECORD.parent.mkdir(exist_ok=True)
    torch.save({"machine": _machine(), "steps": {n: _run(n) for n in sorted(CASES)}}, RECORD)
    print(f"recorded {len(CASES)} cases in {RECORD}")
