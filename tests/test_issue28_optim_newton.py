"""Defaults that train, and blow-ups that do not pass silently (``DiagGGNNewton``, ``KFAC``).

* ``DiagGGNNewton(lr=0.05, damping=1e-3)`` on the digits CNN used to die silently (the loss
  went 2.3 → 2929 → 154217 → 2.30 with every prediction one class); with the default trust
  region it trains: the loss falls, the accuracy rises, the predictions use many classes.
* What the optimizer can see of a blow-up raises or warns: a parameter that the update would
  make non-finite (an overflow of ``θ − Δ`` with finite ``θ`` and ``Δ``) raises, naming the
  optimizer and the options, and changes nothing; a closure whose loss grows to over 1000x
  its first warns.
"""

import math

import pytest
import torch
from torch import nn

import curvopt
from curvopt.optim import KFAC, DiagGGNNewton, VarianceAdaptedSGD
from test_optim_defaults import _digits, _digits_cnn, _one_layer, _train


def test_diag_ggn_newton_with_the_readme_settings_trains_the_digits_cnn():
    X, y = _digits()
    torch.manual_seed(0)  # Monte-Carlo curvature
    model = curvopt.extend(_digits_cnn())
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    opt = DiagGGNNewton(model.parameters(), lr=0.05, damping=1e-3)
    first, loss = _train(opt, lambda a, b: lossfunc(model(a), b), X, y, steps=40, batch=128)
    with torch.no_grad():
        predicted = model(X).argmax(1)
    accuracy = float((predicted == y).float().mean())
    assert math.isfinite(loss) and loss < 0.5 * first, (first, loss)
    assert accuracy > 0.6 and len(predicted.unique()) == 10, accuracy


def _overflowing(make):
    """A float32 layer whose finite update overflows ``θ − Δ``: a bias at ``-3.35e38`` (the
    outputs, all ``-3.35e38`` in float32, give a finite loss and gradient) and an ``lr`` of
    ``3e38`` that moves it further down."""
    layer, lossfunc, x, y = _one_layer()
    layer = layer.float()
    with torch.no_grad():
        layer.bias.fill_(-3.35e38)
    opt = make(layer.named_parameters())
    return layer, opt, lambda: lossfunc(layer(x.float()), y)


@pytest.mark.parametrize(
    "name, make",
    [
        ("KFAC", lambda ps: KFAC(ps, lr=3e38, damping=1.0, curvature="kflr", kl_clip=None)),
        ("DiagGGNNewton", lambda ps: DiagGGNNewton(ps, lr=3e38, damping=1.0, kl_clip=None)),
        ("VarianceAdaptedSGD", lambda ps: VarianceAdaptedSGD(ps, lr=3e38)),
    ],
)
def test_a_finite_update_that_makes_a_parameter_non_finite_raises(name, make):
    layer, opt, loss = _overflowing(make)
    with opt.collect():
        loss().backward()
    before = [p.detach().clone() for p in layer.parameters()]
    assert all(bool(p.grad.isfinite().all()) for p in layer.parameters())
    match = rf"^{name}: the parameter after the step of parameter 'bias' .* not finite.*lr"
    with pytest.raises(FloatingPointError, match=match):
        opt.step()
    assert all(torch.equal(b, p) for b, p in zip(before, layer.parameters()))
    assert not opt.state


def test_a_closure_loss_that_grows_by_orders_of_magnitude_warns():
    layer, lossfunc, x, y = _one_layer()
    opt = KFAC(layer.parameters(), lr=0.1, damping=0.1, kl_clip=None)
    factor = [1.0]

    def closure():
        opt.zero_grad()
        loss = factor[0] * lossfunc(layer(x), y)
        loss.backward()
        return loss

    opt.step(closure)
    factor[0] = 2e3  # the loss of this step 2000x (and more) the first one
    with pytest.warns(RuntimeWarning, match=r"KFAC: the closure's loss .* diverging.*kl_clip"):
        opt.step(closure)


def test_the_silent_death_of_the_paper_update_warns_when_stepped_with_a_closure():
    """The case that died silently, with ``kl_clip=None``: the loss goes 2.32 → 4.16 → 7.48 →
    2929 (all finite); stepped with a closure, the 4th step's loss warns."""
    X, y = _digits()
    torch.manual_seed(0)
    model = curvopt.extend(_digits_cnn())
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    opt = DiagGGNNewton(model.parameters(), lr=0.05, damping=1e-3, kl_clip=None)
    generator = torch.Generator().manual_seed(0)

    def closure():
        opt.zero_grad()
        loss = lossfunc(model(X[index]), y[index])
        loss.backward()
        return loss

    losses = []
    with pytest.warns(RuntimeWarning, match=r"DiagGGNNewton: the closure's loss .*kl_clip=None"):
        for _ in range(5):
            index = torch.randint(0, len(X), (128,), generator=generator)
            losses.append(float(opt.step(closure)))
    assert all(math.isfinite(loss) for loss in losses) and max(losses) > 1e3 * losses[0], losses
