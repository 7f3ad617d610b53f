"""``linalg.GGN`` for every supported loss and reduction against a dense ``torch.func`` GGN
(``Jᵀ ∇²_f L J`` from ``jacrev`` and ``hessian``). ``MSELoss(reduction="mean")`` used to crash
(the forward-mode derivative of its backward writes into an immutable zero tangent)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import curvopt
from curvopt import linalg
from test_linalg import dense_ggn, dense_hessian

DT = torch.float64


def _targets(loss, n, gen):
    if isinstance(loss, nn.CrossEntropyLoss):
        return torch.randint(0, 3, (n,), generator=gen)
    if isinstance(loss, nn.BCEWithLogitsLoss):
        return torch.rand(n, 3, generator=gen, dtype=DT)
    return torch.randn(n, 3, generator=gen, dtype=DT)


@pytest.mark.parametrize("loss_cls", [nn.MSELoss, nn.BCEWithLogitsLoss, nn.CrossEntropyLoss])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_ggn_and_hessian_match_dense_for_every_loss(loss_cls, reduction):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    model = curvopt.extend(nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DT))
    lossfunc = curvopt.extend(loss_cls(reduction=reduction))
    data = [
        (torch.randn(n, 4, generator=gen, dtype=DT), _targets(lossfunc, n, gen)) for n in (3, 2)
    ]
    for operator, dense in ((linalg.GGN, dense_ggn), (linalg.Hessian, dense_hessian)):
        expected = dense(model, lossfunc, data).detach().numpy()
        actual = operator(model, lossfunc, data).to_dense()
        np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-10 * np.abs(expected).max())
