"""The convolutions' ``grad_sum`` (the total that the checks compare with ``p.grad``), and the
checks it serves on convolutions: an extra gradient term, or a wrong per-sample gradient, raises.
"""

import pytest
import torch
from conftest import DT
from test_first_order_layers import CONV, _run_case
from torch import nn

import curvopt
import curvopt.layers.conv
from curvopt import extensions as ext
from curvopt.errors import UnsupportedModuleError
from curvopt.layers.registry import rule_for
from curvopt.core.calls import Call


class _TransposeWithOutputSize(nn.Module):
    """``output_size`` sets the output padding of the call (here 2, the module's is 0)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.ConvTranspose2d(2, 3, 3, stride=3, padding=1)

    def forward(self, x):
        return self.conv(x, output_size=[3 * x.shape[2], 3 * x.shape[3]])


CASES = {**CONV, "T2d-output-size": (_TransposeWithOutputSize, (2, 3, 2))}


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_grad_sum_is_the_weight_gradient_of_the_call(case, n, seed):
    """``sum_n g_n`` of every parameter against autograd's gradient of ``<y, G>``, float64."""
    make, shape = CASES[case]
    model = make().to(DT)
    conv = model.conv if isinstance(model, _TransposeWithOutputSize) else model
    x = torch.randn(n, *shape, dtype=DT)
    y = model(x)
    g = torch.randn_like(y)
    names = [name for name, _ in conv.named_parameters()]
    expected = torch.autograd.grad((y * g).sum(), list(conv.parameters()))
    call = Call(conv, (x,), {}, g)
    for name, want in zip(names, expected):
        total = rule_for(conv).grad_sum(call, name)
        torch.testing.assert_close(total, want, rtol=1e-12, atol=1e-12, msg=f"{case} {name}")


def _conv_net(channels: int = 8):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(channels, 9, 3), nn.Tanh(), nn.Flatten(), nn.Linear(9 * 4, 5)
    ).to(DT)


def _loss(model, penalty: float = 0.0):
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    x = torch.randn(4, 8, 4, 4, dtype=DT)  # 2 x 2 positions: ghost norms
    loss = lossfunc(model(x), torch.arange(4) % 5)
    return loss + penalty * (model[0].weight ** 2).sum()


@pytest.mark.parametrize(
    "extension", [ext.BatchL2Grad, ext.SumGradSquared, ext.Variance, ext.DiagGGNExact]
)
def test_penalty_on_a_conv_weight_raises(extension, seed):
    """An extra term in the conv weight's gradient, in every first-order path (ghost norms,
    chunked per-sample gradients) and in a curvature pass: ``p.grad`` carries the penalty,
    the call's own gradient does not. Were the checked total read from ``p.grad`` (or
    computed with the penalty), this would pass silently."""
    model = curvopt.extend(_conv_net())
    loss = _loss(model, penalty=0.1)
    with pytest.raises(UnsupportedModuleError, match="0.weight.*outside the module"):
        with curvopt.collect(extension()):
            loss.backward()
    assert not hasattr(model[0].weight, extension.attr)


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("extension", [ext.BatchL2Grad, ext.SumGradSquared, ext.Variance])
def test_wrong_conv_per_sample_gradient_raises(extension, grouped, monkeypatch, seed):
    """Per-sample gradients formed in chunks only to be reduced are checked too: their sum is
    the total compared with ``p.grad``, so one wrong ``g_n`` raises instead of giving wrong
    norms or moments."""
    monkeypatch.setattr(curvopt.layers.conv, "_GROUPED_MIN_CHANNELS", 1 if grouped else 10**9)
    monkeypatch.setattr(curvopt.layers.conv.ConvRule, "batch_l2", lambda *args: None)
    original = curvopt.layers.conv.ConvRule.batch_grad

    def wrong(self, call, name, out=None):
        grads = original(self, call, name, out)
        if name == "weight":
            grads[0].mul_(1.01)
        return grads

    model = curvopt.extend(_conv_net())
    with curvopt.collect(extension()):  # correct per-sample gradients pass
        _loss(model).backward()
    model.zero_grad()
    monkeypatch.setattr(curvopt.layers.conv.ConvRule, "batch_grad", wrong)
    loss = _loss(model)
    with pytest.raises(UnsupportedModuleError, match="0.weight"):
        with curvopt.collect(extension()):
            loss.backward()


#: layers whose ``batch_l2`` takes the ghost-norm path (``L (a + b) < a b``)
GHOST = {
    "1d": (lambda: nn.Conv1d(8, 9, 3), (8, 4)),
    "3d": (lambda: nn.Conv3d(4, 5, 2), (4, 2, 2, 2)),
    "T2d": (lambda: nn.ConvTranspose2d(9, 8, 3), (9, 2, 2)),
    "T1d-stride-pad": (lambda: nn.ConvTranspose1d(12, 6, 3, stride=2, padding=1), (12, 2)),
}


@pytest.mark.parametrize("case", list(GHOST))
def test_ghost_norms_of_convolutions(case, seed):
    """The ghost-norm path is taken (chosen from the weight's shape, before unfolding) and
    gives the per-sample gradients' squared norms, each sample's by autograd alone; and the
    whole pass agrees with the per-sample reference."""
    make, shape = GHOST[case]
    module = make().to(DT)
    x = torch.randn(3, *shape, dtype=DT)
    g = torch.randn_like(module(x))
    norms = rule_for(module).batch_l2(Call(module, (x,), {}, g), "weight")
    assert norms is not None
    expected = torch.stack(
        [
            torch.autograd.grad((module(x[i : i + 1]) * g[i : i + 1]).sum(), module.weight)[0]
            .square()
            .sum()
            for i in range(3)
        ]
    )
    torch.testing.assert_close(norms, expected, rtol=1e-12, atol=1e-12)
    _run_case(module, x, "sum")
