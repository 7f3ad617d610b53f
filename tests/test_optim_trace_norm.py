"""The trace-norm damping split of Martens & Grosse (2015, Sec. 6.3), recomputed by hand.

``(B + √λ'/π I) ⊗ (A + π√λ' I)`` with ``λ' = λ + δ`` and ``π = sqrt((tr A/dim A)/(tr B/dim B))``:
the input-side ``A`` gets ``π√λ'``. Inputs scaled by 30 make ``π`` far from 1, so a swapped
split gives a step that differs by orders of magnitude. The reference is a dense
``torch.kron`` of the damped factors and ``torch.linalg.solve`` in float64, for the Cholesky
path, the Woodbury (low-rank) path and ``linalg.KFAC(...).inverse``.
"""

import numpy as np
import pytest
import torch
from torch import nn

import curvopt
from curvopt import extensions as ext
from curvopt import linalg
from curvopt.inversion.factor_inverse import LowRankInverse

DT = torch.float64
SCALE = 30.0


def _problem(in_features, batch, seed=0):
    """A Linear layer on inputs of scale 30 (``tr A/dim A ≈ 900``), cross-entropy over 3 classes."""
    generator = torch.Generator().manual_seed(seed)
    layer = curvopt.extend(nn.Linear(in_features, 3).to(DT))
    with torch.no_grad():
        layer.weight.mul_(0.01)
    x = SCALE * torch.randn(batch, in_features, dtype=DT, generator=generator)
    y = torch.randint(0, 3, (batch,), generator=generator)
    return layer, curvopt.extend(nn.CrossEntropyLoss()), x, y


def _paper_solve(factors, damping, grad):
    """``(B + √λ/π I)⁻¹ ⊗ (A + π√λ I)⁻¹ vec(G)`` (``(B + λI)⁻¹ g`` for ``[B]``), dense."""
    if len(factors) == 1:
        (b,) = factors
        return torch.linalg.solve(b + damping * torch.eye(b.shape[0], dtype=DT), grad.flatten())
    b, a = factors
    pi = ((a.trace() / a.shape[0]) / (b.trace() / b.shape[0])).sqrt()
    root = damping**0.5
    dense = torch.kron(
        b + root / pi * torch.eye(b.shape[0], dtype=DT),
        a + pi * root * torch.eye(a.shape[0], dtype=DT),
    )
    return torch.linalg.solve(dense, grad.flatten())


@pytest.mark.parametrize(
    "in_features, batch, woodbury", [(6, 16, False), (40, 8, True)], ids=["cholesky", "woodbury"]
)
@pytest.mark.parametrize("weight_decay", [0.0, 0.2])
def test_kfac_step_uses_the_paper_split(in_features, batch, woodbury, weight_decay):
    lr, damping = 0.7, 0.3
    layer, lossfunc, x, y = _problem(in_features, batch)
    with curvopt.collect(ext.KFLR()):
        lossfunc(layer(x), y).backward()
    factors = {name: [f.clone() for f in p.kflr] for name, p in layer.named_parameters()}
    b, a = factors["weight"]
    pi = ((a.trace() / a.shape[0]) / (b.trace() / b.shape[0])).sqrt()
    assert pi > 30  # far from 1: a swapped split is off by a factor of ~π² in each factor
    grads = {name: p.grad + weight_decay * p.detach() for name, p in layer.named_parameters()}
    before = {name: p.detach().clone() for name, p in layer.named_parameters()}
    layer.zero_grad()

    opt = curvopt.optim.KFAC(
        layer.parameters(),
        lr=lr,
        damping=damping,
        curvature="kflr",
        weight_decay=weight_decay,
        kl_clip=None,
    )
    with opt.collect():
        lossfunc(layer(x), y).backward()
    opt.step()
    solvers = opt.state[layer.weight]["cholesky"]["value"]
    assert isinstance(solvers[1], LowRankInverse) == woodbury
    for name, p in layer.named_parameters():
        expected = lr * _paper_solve(factors[name], damping + weight_decay, grads[name])
        torch.testing.assert_close(
            (before[name] - p.detach()).flatten(), expected, rtol=1e-9, atol=1e-12
        )


def test_linalg_kfac_inverse_uses_the_paper_split():
    damping = 0.3
    generator = torch.Generator().manual_seed(3)
    model = curvopt.extend(nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).to(DT))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    x = SCALE * torch.randn(12, 5, dtype=DT, generator=generator)
    y = torch.randint(0, 3, (12,), generator=generator)
    K = linalg.KFAC(model, lossfunc, [(x, y)], curvature="kflr")
    b, a = K.factors[0]
    assert ((a.trace() / 5) / (b.trace() / 4)).sqrt() > 30
    vector = torch.randn(sum(p.numel() for p in model.parameters()), dtype=DT, generator=generator)
    expected, offset = [], 0
    for p, factors in zip(model.parameters(), K.factors):
        piece = vector[offset : offset + p.numel()]
        expected.append(_paper_solve(factors, damping, piece))
        offset += p.numel()
    result = K.inverse(damping) @ vector.numpy()
    np.testing.assert_allclose(result, torch.cat(expected).numpy(), rtol=1e-9, atol=1e-12)
