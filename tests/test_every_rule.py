"""Every registered layer rule, checked for every quantity it claims against dense references.

``EXAMPLES`` holds one example module per registered type (a rule registered without an example
fails :func:`test_every_registered_type_has_an_example`). Each example sits in
``layer -> tanh -> flatten -> Linear`` and is checked for BatchGrad and the exact GGN diagonal
(summed and per sample), and for what its rule claims: Kronecker factors (``KFLR``, exact for
one sample at one position), ``curvature_free`` (``DiagHessian`` through it) and ``kfra_weight``
(a ``KFRA`` link). A quantity the rule does not claim must raise, never return numbers.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import DT, ggn_reference, hessian_reference, per_sample_grads_loop
from reference import kfra_mlp
from torch import nn

import curvopt
from curvopt import extensions as ext
from curvopt.errors import UnsupportedKroneckerError, UnsupportedModuleError
from curvopt.layers import registry, rule_for
from conftest import Conv1D
from timm_loader import timm_or_skip


class First(nn.Module):
    """The first output of a module with several (recurrent layers, attention)."""

    def __init__(self, module, self_attention=False):
        super().__init__()
        self.module, self.self_attention = module, self_attention

    def forward(self, x):
        args = (x, x, x) if self.self_attention else (x,)
        return self.module(*args)[0]


def _eval_norm(module):
    """A norm layer in eval mode with non-trivial affine parameters and running statistics."""
    with torch.no_grad():
        module.weight.uniform_(0.5, 1.5)
        module.bias.uniform_(-0.5, 0.5)
        if getattr(module, "running_mean", None) is not None:
            module.running_mean.uniform_(-0.5, 0.5)
            module.running_var.uniform_(0.5, 1.5)
    return module.eval()


def _affine(module):
    with torch.no_grad():
        module.weight.uniform_(0.5, 1.5)
        if getattr(module, "bias", None) is not None:
            module.bias.uniform_(-0.5, 0.5)
    return module


#: registered type -> (example layer, input shape, input shape of one sample at one position
#: for the Kronecker check or None, integer inputs below this vocabulary size or None)
EXAMPLES = {
    nn.Linear: (lambda: nn.Linear(4, 3), (3, 4), (1, 4), None),
    nn.Conv1d: (lambda: nn.Conv1d(2, 3, 2), (3, 2, 4), (1, 2, 2), None),
    nn.Conv2d: (lambda: nn.Conv2d(2, 2, 2), (3, 2, 3, 3), (1, 2, 2, 2), None),
    nn.Conv3d: (lambda: nn.Conv3d(1, 2, 2), (3, 1, 3, 2, 2), (1, 1, 2, 2, 2), None),
    nn.ConvTranspose1d: (lambda: nn.ConvTranspose1d(2, 3, 2), (3, 2, 3), None, None),
    nn.ConvTranspose2d: (lambda: nn.ConvTranspose2d(2, 1, 2, stride=2), (3, 2, 2, 2), None, None),
    nn.ConvTranspose3d: (lambda: nn.ConvTranspose3d(1, 1, 2), (3, 1, 2, 2, 1), None, None),
    nn.Embedding: (lambda: nn.Embedding(5, 3, padding_idx=0), (3, 4), (1, 1), 5),
    nn.LayerNorm: (lambda: _affine(nn.LayerNorm(3)), (3, 2, 3), None, None),
    nn.RMSNorm: (lambda: _affine(nn.RMSNorm(3)), (3, 2, 3), None, None),
    nn.GroupNorm: (lambda: _affine(nn.GroupNorm(2, 4)), (3, 4, 3), None, None),
    nn.modules.instancenorm._InstanceNorm: (
        lambda: _affine(nn.InstanceNorm1d(2, affine=True)),
        (3, 2, 4),
        None,
        None,
    ),
    nn.BatchNorm1d: (lambda: _eval_norm(nn.BatchNorm1d(3)), (3, 3), None, None),
    nn.BatchNorm2d: (lambda: _eval_norm(nn.BatchNorm2d(2)), (3, 2, 2, 2), None, None),
    nn.BatchNorm3d: (lambda: _eval_norm(nn.BatchNorm3d(1)), (3, 1, 2, 1, 2), None, None),
    nn.SyncBatchNorm: (lambda: _eval_norm(nn.SyncBatchNorm(2)), (3, 2, 3), None, None),
    nn.RNNBase: (lambda: First(nn.GRU(3, 2, batch_first=True)), (3, 2, 3), None, None),
    nn.RNN: (lambda: First(nn.RNN(3, 2, batch_first=True)), (3, 2, 3), None, None),
    nn.LSTM: (lambda: First(nn.LSTM(3, 2, batch_first=True)), (3, 2, 3), None, None),
    nn.GRU: (lambda: First(nn.GRU(3, 2, batch_first=True)), (3, 2, 3), None, None),
    nn.MultiheadAttention: (
        lambda: First(nn.MultiheadAttention(4, 2, batch_first=True), self_attention=True),
        (3, 2, 4),
        (1, 1, 4),
        None,
    ),
    nn.PReLU: (lambda: nn.PReLU(1, init=0.3), (3, 4), None, None),
    "Conv1D": (lambda: Conv1D(3, 4), (3, 2, 4), (1, 4), None),
    # timm's layers (registered by qualified name; timm_loader skips where timm is absent)
    "timm.layers.linear.Linear": (lambda: timm_or_skip().layers.Linear(4, 3), (3, 4), (1, 4), None),
    "timm.layers.norm.LayerNorm": (
        lambda: _affine(timm_or_skip().layers.LayerNorm(3)),
        (3, 2, 3),
        None,
        None,
    ),
    "timm.layers.norm.LayerNorm2d": (
        lambda: _affine(timm_or_skip().layers.LayerNorm2d(3)),
        (3, 3, 2, 2),
        None,
        None,
    ),
    "timm.layers.norm_act.BatchNormAct2d": (
        lambda: _eval_norm(timm_or_skip().layers.BatchNormAct2d(2, act_layer=nn.SiLU)),
        (3, 2, 2, 2),
        None,
        None,
    ),
}


def _registered():
    """The types (and class names) curvopt itself registers rules for."""
    types = [t for t in registry._RULES if t.__module__.startswith("torch.")]
    return types + list(registry._NAMED)


def _key(kind):
    return kind if isinstance(kind, str) else kind.__name__


def test_every_registered_type_has_an_example():
    missing = [_key(t) for t in _registered() if t not in EXAMPLES]
    assert not missing, f"add an example for {missing} to EXAMPLES"


def _layer(module):
    return module.module if isinstance(module, First) else module


def _problem(kind, shape, seed=0):
    torch.manual_seed(seed)
    build, _, _, vocab = EXAMPLES[kind]
    layer = build().to(DT)
    X = torch.randint(1, vocab, shape) if vocab else torch.randn(*shape, dtype=DT)
    with torch.no_grad():
        features = layer(X)[0].numel()
    plain = nn.Sequential(layer, nn.Tanh(), nn.Flatten(), nn.Linear(features, 3).to(DT))
    model = curvopt.extend(copy.deepcopy(plain))
    y = torch.randint(0, 3, (shape[0],))
    return plain, model, X, y


def _run(model, X, y, reduction, *extensions):
    lossfunc = curvopt.extend(nn.CrossEntropyLoss(reduction=reduction))
    loss = lossfunc(model(X), y)
    with curvopt.collect(*extensions):
        loss.backward()


def _close(actual, expected, what):
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=1e-7, atol=1e-10 * scale + 1e-13, msg=what)


def _layer_params(model):
    return [(n, p) for n, p in model.named_parameters() if n.startswith("0.")]


KINDS = sorted(EXAMPLES, key=_key)
IDS = [_key(k) for k in KINDS]


def test_examples_use_their_rule():
    for kind in KINDS:
        layer = _layer(EXAMPLES[kind][0]())
        expected = registry._NAMED[kind] if isinstance(kind, str) else registry._RULES[kind]
        assert rule_for(layer) is expected, _key(kind)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("kind", KINDS, ids=IDS)
def test_first_order_and_ggn_diagonal(kind, reduction):
    plain, model, X, y = _problem(kind, EXAMPLES[kind][1])
    _run(model, X, y, reduction, ext.BatchGrad(), ext.DiagGGNExact(), ext.BatchDiagGGNExact())
    loss = nn.CrossEntropyLoss(reduction=reduction)
    grads = per_sample_grads_loop(plain, loss, X, y)
    blocks, per_sample = ggn_reference(plain, loss, X, y)
    for name, p in model.named_parameters():
        _close(p.grad_batch, grads[name], f"{name} grad_batch")
        _close(p.diag_ggn_exact, torch.diagonal(blocks[name]).reshape(p.shape), f"{name} diag")
        _close(p.diag_ggn_exact_batch, per_sample[name], f"{name} diag_ggn_exact_batch")


@pytest.mark.parametrize("kind", KINDS, ids=IDS)
def test_kronecker_factors(kind):
    """Claimed: ``kron(*p.kflr)`` is the exact GGN block for one sample at one position. Not
    claimed: a layer with a parameter of two or more dims raises; one whose parameters are all
    one-dimensional gets their exact blocks (``[B]``), for any batch."""
    one_position = EXAMPLES[kind][2]
    plain, model, X, y = _problem(kind, one_position or EXAMPLES[kind][1])
    if one_position is None and any(p.dim() > 1 for _, p in _layer_params(model)):
        with pytest.raises((UnsupportedKroneckerError, UnsupportedModuleError)):
            _run(model, X, y, "mean", ext.KFLR())
        return
    _run(model, X, y, "mean", ext.KFLR())
    blocks, _ = ggn_reference(plain, nn.CrossEntropyLoss(), X, y)
    for name, p in _layer_params(model):
        _close(torch.kron(*p.kflr) if len(p.kflr) == 2 else p.kflr[0], blocks[name], name)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("kind", KINDS, ids=IDS)
def test_diag_hessian(kind, reduction):
    plain, model, X, y = _problem(kind, EXAMPLES[kind][1])
    if not rule_for(_layer(plain[0])).curvature_free:
        with pytest.raises(UnsupportedModuleError, match="DiagHessian"):
            _run(model, X, y, reduction, ext.DiagHessian())
        return
    _run(model, X, y, reduction, ext.DiagHessian(), ext.BatchDiagHessian())
    diag, per_sample = hessian_reference(plain, nn.CrossEntropyLoss(reduction=reduction), X, y)
    for name, p in model.named_parameters():
        _close(p.diag_h, diag[name], f"{name} diag_h")
        _close(p.diag_h_batch, per_sample[name], f"{name} diag_h_batch")


@pytest.mark.parametrize("kind", KINDS, ids=IDS)
def test_kfra(kind):
    """Claimed (``kfra_weight``): the layer as a link of ``layer -> tanh -> Linear`` on
    two-dimensional inputs against Botev et al.'s recursion."""
    plain, model, X, y = _problem(kind, EXAMPLES[kind][1])
    layer = _layer(plain[0])
    if rule_for(layer).kfra_weight(layer) is None:
        with pytest.raises(UnsupportedModuleError, match="KFRA"):
            _run(model, X, y, "mean", ext.KFRA())
        return
    X = X.flatten(0, -2)[:4]
    y = torch.randint(0, 3, (X.shape[0],))
    chain = nn.Sequential(plain[0], nn.Tanh(), nn.Linear(plain[0].out_features, 3).to(DT))
    model = curvopt.extend(copy.deepcopy(chain))
    _run(model, X, y, "mean", ext.KFRA())
    b = kfra_mlp(chain, nn.CrossEntropyLoss(), X, y)
    _close(model[0].weight.kfra[0], b[0], "B")
    _close(model[0].weight.kfra[1], X.T @ X / X.shape[0], "A")
    _close(model[0].bias.kfra[0], b[0], "bias B")
