"""``BatchNormRule.normalized``: the input normalised as the forward normalised it.

With batch statistics (training mode, or no running statistics) the rule takes ``x_hat`` from
the forward's own kernel; it must equal ``(x - mean) / sqrt(var + eps)`` with the batch's mean
and biased variance over every dim but the channels (computed here independently, in float64),
and its affine map must give the module's output. In eval mode with running statistics it
normalises with those."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from curvopt.layers import rule_for

DT = torch.float64

#: (module class, input shape): odd sizes, every rank BatchNorm takes
CASES = [
    (nn.BatchNorm1d, (5, 3)),
    (nn.BatchNorm1d, (4, 3, 7)),
    (nn.BatchNorm2d, (3, 5, 4, 6)),
    (nn.BatchNorm3d, (2, 3, 3, 4, 5)),
]


def _reference(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)``, statistics over all dims but dim 1, by sums."""
    dims = [d for d in range(x.dim()) if d != 1]
    count = x.numel() // x.shape[1]
    mean = x.sum(dims, keepdim=True) / count
    var = ((x - mean) ** 2).sum(dims, keepdim=True) / count
    return (x - mean) / torch.sqrt(var + eps)


def _module(cls, channels: int, seed: int, **options) -> nn.Module:
    torch.manual_seed(seed)
    module = cls(channels, **options).to(DT)
    with torch.no_grad():
        module.weight.normal_()
        module.bias.normal_()
        if module.running_mean is not None:
            module.running_mean.normal_()
            module.running_var.uniform_(0.5, 2.0)
    return module


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    "cls, shape, channels_last", [*((*case, False) for case in CASES), (*CASES[2], True)]
)
def test_batch_statistics_normalise_as_the_forward(cls, shape, channels_last, seed):
    module = _module(cls, shape[1], seed, eps=1e-3)
    x = torch.randn(*shape, dtype=DT) * 3 + 2
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    x_hat = rule_for(module).normalized(module, x)
    torch.testing.assert_close(x_hat, _reference(x, module.eps), rtol=1e-12, atol=1e-12)
    view = [1, -1] + [1] * (x.dim() - 2)
    affine = x_hat * module.weight.detach().view(view) + module.bias.detach().view(view)
    with torch.no_grad():
        torch.testing.assert_close(affine, module(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cls, shape", CASES)
def test_without_running_statistics_eval_mode_uses_the_batch(cls, shape):
    module = _module(cls, shape[1], 0, track_running_stats=False).eval()
    x = torch.randn(*shape, dtype=DT) - 1
    x_hat = rule_for(module).normalized(module, x)
    torch.testing.assert_close(x_hat, _reference(x, module.eps), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cls, shape", CASES)
def test_eval_mode_uses_the_running_statistics(cls, shape):
    module = _module(cls, shape[1], 0).eval()
    x = torch.randn(*shape, dtype=DT)
    view = [1, -1] + [1] * (x.dim() - 2)
    mean, var = module.running_mean.view(view), module.running_var.view(view)
    expected = (x - mean) / torch.sqrt(var + module.eps)
    x_hat = rule_for(module).normalized(module, x)
    torch.testing.assert_close(x_hat, expected, rtol=1e-12, atol=1e-12)
