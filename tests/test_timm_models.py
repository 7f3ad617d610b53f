"""timm's models as timm ships them (issue 61): resnet10t, mobilenetv3_small_050,
efficientnet_b0, a VisionTransformer and a ConvNeXt (in training mode also with drop path).

* eval mode, float64: per-sample gradients equal ``torch.func``'s and the exact GGN diagonal
  equals the dense ``Jᵀ H J``'s, with every timm layer on its own rule (no subclass warning);
* ``BatchNormAct2d`` in training mode (batch statistics): the Monte-Carlo curvature equals that
  of the same network written as ``nn.BatchNorm2d`` then the activation, draw for draw;
* "the swap trains": ``KFAC``, ``EKFAC``, ``DiagGGNNewton`` at their defaults (the optimizer
  line changed, ``lr=0.1``) train the three convolutional networks in training mode on one
  fixed batch of 8 at 32x32, reaching half of AdamW's (``lr=1e-2``) progress in the same steps.
  By default on narrow variants of the same architectures (timm's own constructors at smaller
  widths, so that the file runs in seconds); the named models at their sizes with ``-m slow``.

timm comes from ``tests/timm_loader.py`` (its torchvision stand-in; skipped without timm).
Measured progress (8 steps, the first loss minus the mean of the last three; KFAC, EKFAC,
DiagGGNNewton as a fraction of AdamW's, seeds 0, 1, 2): narrow resnet10t 0.73-1.00; narrow
efficientnet_b0 0.82-1.05; mobilenetv3 (0.25) 0.88-1.25 where AdamW progressed (seed 1; at seeds
0 and 2 AdamW's loss spiked and ended above its start, curvopt's all went down). EKFAC at its
default ``basis_source="last_refresh"``: 0.93-1.00, 1.00-1.05 and 1.25.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import DT, per_sample_grads_vmap
from timm_loader import timm_or_skip
from torch import nn
from torch.func import functional_call, hessian, jacrev

import curvopt
from curvopt import extensions as ext
from curvopt.layers import rule_for
from curvopt.layers.timm_layers import BatchNormAct2dRule, LayerNorm2dRule

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # timm's torch.jit use


def resnet10t(narrow=True):
    extra = dict(channels=(8, 16, 32, 64), stem_width=8) if narrow else {}
    return timm_or_skip().create_model("resnet10t", num_classes=3, **extra)


def mobilenetv3(narrow=True):
    timm = timm_or_skip()
    if narrow:  # mobilenetv3_small_050's constructor at a quarter of the widths
        return timm.models.mobilenetv3._gen_mobilenet_v3(
            "mobilenetv3_small_050", 0.25, num_classes=3
        )
    return timm.create_model("mobilenetv3_small_050", num_classes=3)


def efficientnet_b0(narrow=True):
    timm = timm_or_skip()
    if narrow:  # efficientnet_b0's constructor at a quarter of the widths and depths
        return timm.models.efficientnet._gen_efficientnet(
            "efficientnet_b0", channel_multiplier=0.25, depth_multiplier=0.25, num_classes=3
        )
    return timm.create_model("efficientnet_b0", num_classes=3)


def vit(narrow=True):
    return timm_or_skip().models.vision_transformer.VisionTransformer(
        img_size=16, patch_size=8, embed_dim=16, depth=2, num_heads=2, num_classes=3
    )


def convnext(narrow=True):
    return timm_or_skip().models.convnext.ConvNeXt(
        depths=(1, 1, 1, 1), dims=(8, 8, 16, 16), num_classes=3
    )


MODELS = {
    "resnet10t": (resnet10t, 32),
    "mobilenetv3_small_050": (mobilenetv3, 32),
    "efficientnet_b0": (efficientnet_b0, 32),
    "vit": (vit, 16),
    "convnext": (convnext, 32),
}


def _eval_problem(name, n=3):
    torch.manual_seed(0)
    build, size = MODELS[name]
    model = build().to(DT).eval()
    with torch.no_grad():  # running statistics away from (0, 1), so eval mode is not trivial
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.uniform_(-0.2, 0.2)
                module.running_var.uniform_(0.5, 1.5)
    X = torch.randn(n, 3, size, size, dtype=DT)
    return model, X, torch.randint(0, 3, (n,))


def _ggn_diagonal(model, X, y):
    """``name -> diag(Jᵀ H J)`` from the dense Jacobian of all outputs (``[N C, P]``) and the
    dense Hessian of the mean cross-entropy in the outputs."""
    params = {k: p.detach() for k, p in model.named_parameters()}
    out = functional_call(model, params, (X,)).detach()
    jac = jacrev(lambda p: functional_call(model, p, (X,)))(params)
    h = hessian(lambda o: F.cross_entropy(o, y))(out).reshape(out.numel(), out.numel())
    result = {}
    for k, p in params.items():
        j = jac[k].reshape(out.numel(), -1)
        result[k] = torch.einsum("rp,rs,sp->p", j, h, j).reshape(p.shape)
    return result


@pytest.mark.parametrize("name", MODELS)
def test_eval_mode_per_sample_gradients_and_ggn_diagonal(name):
    model, X, y = _eval_problem(name)
    expected_grads = per_sample_grads_vmap(model, nn.CrossEntropyLoss(), X, y)
    expected_diag = _ggn_diagonal(model, X, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no subclass falls back with a warning
        curvopt.extend(model)
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    with curvopt.collect(ext.BatchGrad(), ext.DiagGGNExact()):
        lossfunc(model(X), y).backward()
    for key, p in model.named_parameters():
        scale = expected_grads[key].abs().max().item()
        torch.testing.assert_close(p.grad_batch, expected_grads[key], rtol=1e-7, atol=1e-10 * scale)
        scale = expected_diag[key].abs().max().item()
        torch.testing.assert_close(
            p.diag_ggn_exact, expected_diag[key], rtol=1e-7, atol=1e-10 * scale + 1e-300
        )


def test_timm_layers_get_their_rules():
    timm = timm_or_skip()
    layers = timm.layers
    assert type(rule_for(layers.BatchNormAct2d(4))) is BatchNormAct2dRule
    assert type(rule_for(layers.LayerNorm2d(4))) is LayerNorm2dRule
    assert (
        rule_for(layers.Linear(2, 2)) is curvopt.layers.registry._NAMED["timm.layers.linear.Linear"]
    )
    mobile = mobilenetv3()
    kinds = {type(rule_for(m)) for m in mobile.modules() if isinstance(m, layers.BatchNormAct2d)}
    assert kinds == {BatchNormAct2dRule}


def _pair(act):
    """The same network twice: with timm's ``BatchNormAct2d`` and as ``nn.BatchNorm2d`` then
    the activation."""
    timm = timm_or_skip()
    torch.manual_seed(0)
    conv, head = nn.Conv2d(2, 3, 3, padding=1), nn.Linear(3 * 4 * 4, 3)
    fused = timm.layers.BatchNormAct2d(3, act_layer=act)
    plain = nn.BatchNorm2d(3)
    with torch.no_grad():
        fused.weight.uniform_(0.5, 1.5)
        fused.bias.uniform_(-0.5, 0.5)
    plain.load_state_dict(fused.state_dict())
    first = nn.Sequential(conv, fused, nn.Flatten(), head).to(DT)
    second = nn.Sequential(conv, plain, act(), nn.Flatten(), head).to(DT)
    return curvopt.extend(copy.deepcopy(first)), curvopt.extend(copy.deepcopy(second))


@pytest.mark.parametrize("act", [nn.ReLU, nn.SiLU, nn.Hardswish])
def test_batch_norm_act_in_training_mode_matches_batch_norm_then_activation(act):
    fused, plain = _pair(act)
    X = torch.randn(6, 2, 4, 4, dtype=DT)
    y = torch.randint(0, 3, (6,))
    results = []
    for model in (fused, plain):
        lossfunc = curvopt.extend(nn.CrossEntropyLoss())
        torch.manual_seed(1)
        with curvopt.collect(ext.KFAC(), ext.DiagGGNMC(), ext.EKFAC()):
            lossfunc(model.train()(X), y).backward()
        results.append([p for p in model.parameters()])
    for p, q in zip(*results):
        torch.testing.assert_close(p.grad, q.grad)
        torch.testing.assert_close(p.diag_ggn_mc, q.diag_ggn_mc)
        for a, b in zip(p.kfac, q.kfac):
            torch.testing.assert_close(a, b)
        torch.testing.assert_close(p.ekfac[0], q.ekfac[0])
    assert any(p.diag_ggn_mc.abs().sum() > 0 for p in results[0])


def test_batch_norm_act_refuses_what_it_cannot_replay():
    timm = timm_or_skip()
    layer = timm.layers.BatchNormAct2d(3, drop_layer=lambda: timm.layers.DropBlock2d(0.1))
    assert "drop layer DropBlock2d draws random numbers" in rule_for(layer).check(layer)
    layer.eval()
    assert rule_for(layer).check(layer) is None

    class Channelwise(nn.Module):  # an activation that mixes channels: not elementwise
        def forward(self, x):
            return x.softmax(1)

    layer.act = Channelwise()
    assert "activation Channelwise is not one curvopt knows" in rule_for(layer).check(layer)


# ------------------------------------------------------------------------ the swap trains

OPTIMIZERS = {
    "AdamW": lambda params: torch.optim.AdamW(params, lr=1e-2),  # the line users replace
    "KFAC": lambda params: curvopt.optim.KFAC(params, lr=0.1),
    "EKFAC": lambda params: curvopt.optim.EKFAC(params, lr=0.1),
    "DiagGGNNewton": lambda params: curvopt.optim.DiagGGNNewton(params, lr=0.1),
}
TRAINED = ["resnet10t", "mobilenetv3_small_050", "efficientnet_b0"]


def vit_drop_path(narrow=True):
    """The ViT above with stochastic depth and dropout, as timm's recipes train it."""
    return timm_or_skip().models.vision_transformer.VisionTransformer(
        img_size=16,
        patch_size=8,
        embed_dim=16,
        depth=2,
        num_heads=2,
        num_classes=3,
        drop_path_rate=0.2,
        drop_rate=0.1,
        proj_drop_rate=0.1,
    )


def convnext_drop_path(narrow=True):
    return timm_or_skip().models.convnext.ConvNeXt(
        depths=(1, 1, 1, 1), dims=(8, 8, 16, 16), num_classes=3, drop_path_rate=0.2
    )


#: trained in training mode only: their random draws (drop path, dropout) are replayed
DROP_PATH = {"vit_drop_path": (vit_drop_path, 16), "convnext_drop_path": (convnext_drop_path, 32)}


def _train(name, optimizer, narrow, steps, seed=0):
    torch.manual_seed(seed)
    make, size = {**MODELS, **DROP_PATH}[name]
    model = make(narrow)
    if optimizer != "AdamW":
        model = curvopt.extend(model)
    model.train()
    generator = torch.Generator().manual_seed(seed)
    X = torch.randn(8, 3, size, size, generator=generator)
    y = torch.randint(0, 3, (8,), generator=generator)
    opt = OPTIMIZERS[optimizer](model.parameters())
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the diagonal fallback's announcement
        for _ in range(steps):
            opt.zero_grad()
            loss = F.cross_entropy(model(X), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses


def _progress(losses):
    """First loss minus the mean of the last three."""
    return losses[0] - sum(losses[-3:]) / 3


def _check_swap(name, narrow, steps, seed=0):
    reference = _progress(_train(name, "AdamW", narrow, steps, seed))
    for optimizer in ("KFAC", "EKFAC", "DiagGGNNewton"):
        losses = _train(name, optimizer, narrow, steps, seed)
        assert all(math.isfinite(v) for v in losses), (optimizer, losses)
        assert _progress(losses) >= 0.5 * reference, (optimizer, reference, losses)
        assert min(losses) < losses[0], (optimizer, losses)


@pytest.mark.parametrize("name", TRAINED)
def test_the_swap_trains(name):
    _check_swap(name, narrow=True, steps=8)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", list(DROP_PATH))
def test_the_swap_trains_with_drop_path(name, seed):
    """A timm ViT (drop path 0.2, dropout) and a ConvNeXt (drop path 0.2) in training mode: 30
    steps at the defaults make half of AdamW's progress (measured: 0.80-1.01 of it)."""
    _check_swap(name, narrow=True, steps=30, seed=seed)


@pytest.mark.slow
@pytest.mark.parametrize("name", TRAINED)
def test_the_swap_trains_the_named_models(name):
    _check_swap(name, narrow=False, steps=30)
