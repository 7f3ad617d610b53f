"""Typed values (``curvopt.core.values``): what the optimizers read instead of names and
positions.

Under ``torch.amp.GradScaler`` with a scale that changes every step and ``curvature_ema``, the
optimizer averages curvature of passes with different scales, so each value must be unscaled
where it carries the scale (the output-side Kronecker factor, whichever position it has; ``S``
of ``[S, *bases]``). Checked for every layer rule that has Kronecker factors (the examples of
``test_every_rule``) against an unscaled float64 twin: the parameters after 4 steps agree.
"""

from __future__ import annotations

import pytest
import torch
from test_every_rule import EXAMPLES, IDS, KINDS, _layer_params, _problem
from torch import nn

import curvopt
from curvopt import extensions as ext
from curvopt.optim import EKFAC, KFAC, DiagGGNNewton
from curvopt.optim.distributed.common import leaves, rebuild
from curvopt.core.values import EigenCorrected, KroneckerFactors, unscaled
from conftest import scaled_step


def _has_factors(kind) -> bool:
    """Whether the rule of ``kind`` claims Kronecker factors (as ``test_kronecker_factors``)."""
    if EXAMPLES[kind][2] is not None:
        return True
    _, model, _, _ = _problem(kind, EXAMPLES[kind][1])
    return all(p.dim() == 1 for _, p in _layer_params(model))


FACTORED = [(kind, name) for kind, name in zip(KINDS, IDS) if _has_factors(kind)]

OPTIMIZERS = {
    "KFAC": lambda ps: KFAC(ps, lr=0.1, damping=1e-2, curvature_ema=0.5, kl_clip=None),
    "KFAC-kflr-exact": lambda ps: KFAC(
        ps, lr=0.1, damping=1e-2, curvature="kflr", kronecker_damping="exact", curvature_ema=0.8
    ),
    "EKFAC": lambda ps: EKFAC(ps, lr=0.1, damping=1e-2, basis_interval=2, kl_clip=None),
    "DiagGGNNewton": lambda ps: DiagGGNNewton(ps, lr=0.1, damping=1e-2, curvature_ema=0.5),
}


def _trained(kind, make, scaler, steps=4):
    """The parameters after ``steps`` steps on one batch, with or without ``scaler``."""
    _, model, X, y = _problem(kind, EXAMPLES[kind][1])
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    opt = make(model.parameters())
    for step in range(steps):
        opt.zero_grad()
        torch.manual_seed(10 + step)
        scaled_step(opt, lossfunc(model(X), y), scaler)
    if scaler is not None:
        assert scaler.get_scale() == 16 * 2**steps  # the scale changed at every step
    return torch.cat([p.detach().flatten() for p in model.parameters()])


CASES = [
    pytest.param(kind, name, id=f"{name}-{kind_id}")
    for kind, kind_id in FACTORED
    for name in OPTIMIZERS
    if name != "DiagGGNNewton" or kind_id in ("Linear", "Embedding", "Conv2d", "LayerNorm")
]


@pytest.mark.parametrize("kind, name", CASES)
def test_a_changing_loss_scale_gives_the_unscaled_steps(kind, name):
    start = torch.cat(
        [p.detach().flatten() for p in _problem(kind, EXAMPLES[kind][1])[1].parameters()]
    )
    plain = _trained(kind, OPTIMIZERS[name], None)
    scaler = torch.amp.GradScaler("cpu", init_scale=16.0, growth_interval=1)
    scaled = _trained(kind, OPTIMIZERS[name], scaler)
    assert (plain - start).norm() > 1e-3  # the optimizer moved
    torch.testing.assert_close(scaled, plain, rtol=1e-10, atol=1e-12)


def test_the_rules_with_an_output_side_at_index_1_are_covered():
    covered = {name for _, name in FACTORED}
    assert {"Linear", "Conv2d", "Embedding", "Conv1D", "LayerNorm"} <= covered


@pytest.mark.parametrize("kind, side", [(nn.Linear, 0), (nn.Embedding, 1), ("Conv1D", 1)])
def test_collect_writes_factors_that_know_their_output_side(kind, side):
    _, model, X, y = _problem(kind, EXAMPLES[kind][1])
    loss = curvopt.extend(nn.CrossEntropyLoss())(model(X), y)
    with curvopt.collect(ext.KFLR(), ext.EKFAC(factors="kflr")):
        loss.backward()
    weight = model[0].weight
    assert type(weight.kflr) is KroneckerFactors and isinstance(weight.kflr, list)
    assert weight.kflr.output_index == side
    # the output side is the factor of the loss's columns: it scales with the loss, the input
    # side (a mean over inputs) does not
    first = [f.clone() for f in weight.kflr]
    model.zero_grad()
    loss = curvopt.extend(nn.CrossEntropyLoss())(model(X), y)
    with curvopt.collect(ext.KFLR()):
        (3.0 * loss).backward()
    for index, (old, new) in enumerate(zip(first, weight.kflr)):
        torch.testing.assert_close(new, old * (3.0 if index == side else 1.0))
    assert type(weight.ekfac) is EigenCorrected and len(weight.ekfac.bases) == 2


def test_unscaled_divides_each_value_where_it_carries_the_scale():
    b, a = torch.eye(2, dtype=torch.float64) * 4, torch.eye(3, dtype=torch.float64) * 5
    factors = unscaled(ext.quantity("kfac"), KroneckerFactors([a, b], output_index=1), 2.0)
    torch.testing.assert_close(factors[0], a)
    torch.testing.assert_close(factors[1], b / 2)
    assert factors.output_index == 1
    plain = unscaled(ext.quantity("kfac"), [b, a], 2.0)  # set by hand: the contract's order
    torch.testing.assert_close(plain[0], b / 2)
    s = torch.ones(2, 3, dtype=torch.float64)
    corrected = unscaled(ext.quantity("ekfac"), EigenCorrected([s, b, a]), 2.0)
    torch.testing.assert_close(corrected.eigenvalues, s / 2)  # c = D / w: the scale once
    assert corrected.bases[0] is b
    torch.testing.assert_close(unscaled(ext.quantity("variance"), s, 2.0), s / 4)
    torch.testing.assert_close(unscaled(ext.quantity("diag_ggn_mc"), s, 2.0), s / 2)
    assert unscaled(ext.quantity("kfac"), factors, None) is factors


def test_distributed_averaging_rebuilds_values_of_the_same_type():
    """The rank average of ``p.kfac`` keeps its output side (an Embedding's is second)."""
    b, a = torch.eye(2, dtype=torch.float64), torch.eye(3, dtype=torch.float64)
    factors = KroneckerFactors([a, b], output_index=1)
    average = rebuild(factors, iter([t * 2 for t in leaves(factors)]))
    assert type(average) is KroneckerFactors and average.output_index == 1
    torch.testing.assert_close(average.output_side, 2 * b)
    corrected = rebuild(EigenCorrected([a, b]), iter([a, b]))
    assert type(corrected) is EigenCorrected
