"""Per-sample conv weight gradients: the grouped-convolution kernel and the unfolded patches
give the same Monte-Carlo curvature (one sampled column per sample), for every conv layout."""

import pytest
import torch
from test_first_order_layers import CONV
from torch import nn

import curvopt
import curvopt.layers.conv
from curvopt import extensions as ext

DT = torch.float64


def _mc(make, shape, grouped: bool, monkeypatch):
    monkeypatch.setattr(curvopt.layers.conv, "_GROUPED_MIN_CHANNELS", 1 if grouped else 10**9)
    torch.manual_seed(0)
    conv = make().to(DT)
    model = curvopt.extend(nn.Sequential(conv, nn.Tanh(), nn.Flatten()))
    x = torch.randn(3, *shape, dtype=DT)
    out = model(x)
    loss = curvopt.extend(nn.CrossEntropyLoss())(out, torch.arange(3) % out.shape[1])
    torch.manual_seed(1)
    with curvopt.collect(ext.DiagGGNMC(), ext.BatchDiagGGNMC(), ext.BatchGrad()):
        loss.backward()
    w = conv.weight
    return w.diag_ggn_mc, w.diag_ggn_mc_batch, w.grad_batch


@pytest.mark.parametrize("case", [c for c in CONV if not c.startswith("T")])
def test_grouped_kernel_gives_the_unfolded_monte_carlo_diagonal(case, monkeypatch):
    make, shape = CONV[case]
    unfolded = _mc(make, shape, False, monkeypatch)
    grouped = _mc(make, shape, True, monkeypatch)
    for a, b in zip(unfolded, grouped):
        torch.testing.assert_close(a, b)
    assert float(unfolded[0].abs().sum()) > 0


@pytest.mark.parametrize("per_column_left", [True, False])
@pytest.mark.parametrize("groups", [1, 3])
def test_column_products_by_columns_and_arranged_agree_with_einsum(groups, per_column_left):
    """``_column_outer``'s two layouts (one ``bmm`` per column, or one on the per-column operand
    arranged sample-major) against the per-group products written out by ``einsum``."""
    k, n, a, b, length = 4, 5, 2, 3, 7
    torch.manual_seed(0)
    left = torch.randn((k if per_column_left else 1) * n, groups * a, length, dtype=DT)
    right = torch.randn((1 if per_column_left else k) * n, groups * b, length, dtype=DT)
    lg = left.reshape(-1, n, groups, a, length).expand(k, n, groups, a, length)
    rg = right.reshape(-1, n, groups, b, length).expand(k, n, groups, b, length)
    expected = torch.einsum("kngal,kngbl->nkgab", lg, rg).reshape(n, k, groups * a, b)
    conv = curvopt.layers.conv
    for outer in (conv._column_outer_by_columns, conv._column_outer_arranged):
        found = outer(left, right, k, n, groups, per_column_left)
        torch.testing.assert_close(found, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(conv._column_outer(left, right, k, n, groups), expected)
