"""``linalg``'s damped inverses are the optimizers' own preconditioning: one code path.

``linalg.KFAC(...).inverse(λ, kronecker_damping)``, ``linalg.Diagonal(...).inverse(λ)`` and
``linalg.EKFAC(...).inverse(λ)`` applied to the gradient give exactly (``np.array_equal``, in
float32, where a second implementation of "the same" inverse, e.g. explicit inverses instead
of triangular solves, shows in the last bits) the direction ``d`` that ``optim.KFAC``,
``optim.DiagGGNNewton`` and ``optim.EKFAC`` step by, on one batch of 4 samples (the batch
weights of ``linalg`` are then exact). The step is read as ``0 − 1.0 · d``: the parameters
are set to zero after the backward pass (the step does not depend on them without weight
decay) and ``lr = 1``.
"""

import numpy as np
import pytest
import torch
from torch import nn

import curvopt
from curvopt import linalg, optim

LAMBDA = 0.05

#: name -> (linalg operator and its inverse, the optimizer taking the same step)
CASES = {
    "kfac_trace_norm": (
        lambda m, f, d: linalg.KFAC(m, f, d, "kflr").inverse(LAMBDA),
        lambda p: optim.KFAC(p, 1.0, LAMBDA, "kflr", kl_clip=None),
    ),
    "kfac_exact": (
        lambda m, f, d: linalg.KFAC(m, f, d, "kflr").inverse(LAMBDA, "exact"),
        lambda p: optim.KFAC(p, 1.0, LAMBDA, "kflr", kronecker_damping="exact", kl_clip=None),
    ),
    "diagonal": (
        lambda m, f, d: linalg.Diagonal(m, f, d, "ggn_exact").inverse(LAMBDA),
        lambda p: optim.DiagGGNNewton(p, 1.0, LAMBDA, "exact", kl_clip=None),
    ),
    "ekfac": (
        lambda m, f, d: linalg.EKFAC(m, f, d, "kflr").inverse(LAMBDA),
        # linalg.EKFAC's basis is its data's factors': the paper's update, this step's own
        lambda p: optim.EKFAC(p, 1.0, LAMBDA, "kflr", kl_clip=None, basis_source="current"),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_linalg_inverse_applies_the_optimizers_direction(name):
    make_inverse, make_optimizer = CASES[name]
    torch.manual_seed(0)
    model = curvopt.extend(nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    X, y = torch.randn(4, 5), torch.tensor([0, 2, 1, 2])
    inverse = make_inverse(model, lossfunc, [(X, y)])

    opt = make_optimizer(model.parameters())
    opt.zero_grad()
    with opt.collect():
        lossfunc(model(X), y).backward()
    grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    opt.step()
    direction = -torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()

    applied = inverse @ grad
    assert applied.dtype == np.float32 and np.abs(direction).max() > 0
    assert np.array_equal(applied, direction), np.abs(applied - direction).max()
