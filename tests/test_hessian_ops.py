"""``DiagHessian`` / ``BatchDiagHessian`` on models containing ops whose second derivative is
zero (linear or piecewise linear in their inputs), against ``torch.func.hessian`` in float64.

Every op sits between two curved nonlinearities, so the residual curvature of the first is
seen through the op's forward (its delta) and that of the second through the op's transpose
(its columns). ``PReLU``'s weight is a parameter: ``d^2 y / da^2 = 0`` and the cross term
``d^2 y / (du da) = 1[u < 0]`` pairs the weight with upstream parameters (off the diagonal),
so the diagonal is the GGN's plus the residuals of the other nonlinearities.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    DT,
    assert_close,
    assert_no_attributes,
    extended_copy,
    run_second_order,
    trainable,
)
from torch import nn
from torch.func import functional_call

import curvopt
from curvopt import extensions as ext
from curvopt.autograd import torch_internals
from curvopt.errors import CurvoptError

N = 3


def _diagonal(loss, q):
    """``diag(d^2 loss / d q^2)`` by reverse over reverse (several of these ops have no
    forward-mode derivative of their backward, which ``torch.func.hessian`` needs)."""
    (g,) = torch.autograd.grad(loss, q, create_graph=True)
    g = g.flatten()
    rows = [
        torch.autograd.grad(g[i], q, retain_graph=True, allow_unused=True)[0]
        for i in range(g.numel())
    ]
    return torch.stack(
        [
            torch.zeros((), dtype=q.dtype) if r is None else r.flatten()[i]
            for i, r in enumerate(rows)
        ]
    ).reshape(q.shape)


def hessian_diagonals(plain, lossfunc, x, target):
    """``(diag, per_sample)`` of the loss Hessian for every parameter; ``per_sample[n]`` is the
    diagonal w.r.t. a copy of the parameter used by sample ``n`` alone."""
    params = {k: p.detach() for k, p in trainable(plain).items()}
    diag, per_sample = {}, {}
    for k, p in params.items():
        q = p.clone().requires_grad_(True)
        diag[k] = _diagonal(lossfunc(functional_call(plain, {**params, k: q}, (x,)), target), q)
        rows = []
        for n in range(x.shape[0]):
            q = p.clone().requires_grad_(True)
            outs = [
                functional_call(plain, {**params, k: q if i == n else p}, (x[i : i + 1],))
                for i in range(x.shape[0])
            ]
            rows.append(_diagonal(lossfunc(torch.cat(outs), target), q))
        per_sample[k] = torch.stack(rows)
    return diag, per_sample


def check_hessian(plain, x, reduction, target, reference=None, rtol=None):
    plain = plain.to(DT)
    lossfunc = nn.CrossEntropyLoss(reduction=reduction)
    diag, per_sample = hessian_diagonals(reference or plain, lossfunc, x, target)
    model = extended_copy(plain)
    run_second_order(
        model, curvopt.extend(lossfunc), x, target, ext.DiagHessian(), ext.BatchDiagHessian()
    )
    for name, p in trainable(model).items():
        if rtol is None:
            assert_close(p.diag_h, diag[name], f"{name}.diag_h")
            assert_close(p.diag_h_batch, per_sample[name], f"{name}.diag_h_batch")
        else:
            scale = diag[name].abs().max()
            torch.testing.assert_close(p.diag_h, diag[name], rtol=rtol, atol=rtol * scale)
            torch.testing.assert_close(
                p.diag_h_batch, per_sample[name], rtol=rtol, atol=rtol * scale
            )


#: op on ``h [N, 4, 2, 2]``; a module class (built per test); or ``(op, reference)`` where the
#: op has no double backward (the reference is the same function written differently)
SPATIAL = {
    "hardsigmoid": (F.hardsigmoid, lambda h: (h + 3).clamp(0, 6) / 6),
    "softshrink": lambda h: F.softshrink(h, 0.3),
    "hardshrink": lambda h: F.hardshrink(h, 0.3),
    "where": lambda h: torch.where(h > 0, h, 0.5 * h.flip(1)),
    "adaptive-max-pool": nn.AdaptiveMaxPool2d((1, 2)),
    "adaptive-max-pool1d": lambda h: F.adaptive_max_pool1d(h.flatten(2), 3),
    "max-unpool": lambda h: F.max_unpool2d(*F.max_pool2d(h, 2, return_indices=True), 2),
    "nearest": nn.Upsample(scale_factor=2),
    "nearest-exact": lambda h: F.interpolate(h, scale_factor=1.5, mode="nearest-exact"),
    "bilinear": nn.Upsample(scale_factor=2, mode="bilinear"),
    "bilinear-aligned": lambda h: F.interpolate(
        h, size=(5, 3), mode="bilinear", align_corners=True
    ),
    "bicubic": nn.Upsample(scale_factor=2, mode="bicubic"),
    "linear1d": lambda h: F.interpolate(h.flatten(2), scale_factor=2, mode="linear"),
    "trilinear": lambda h: F.interpolate(h[:, None], scale_factor=2, mode="trilinear"),
    "pixel-shuffle": nn.PixelShuffle(2),
    "pixel-unshuffle": nn.PixelUnshuffle(2),
    "no-op-slice": lambda h: h[:, slice(0, None), :],
    "full-slice": lambda h: h[:, :],
    "ellipsis": lambda h: h[...],
    "copy-cast": lambda h: h.to(torch.float64, copy=True),  # ToCopyBackward0, as a dtype cast
    "abs": torch.abs,
    "clamp": lambda h: h.clamp(-0.3, 0.4),
    "clamp-min": lambda h: h.clamp(min=0.1),
    "max": lambda h: h.max(1, keepdim=True)[0] + h.amax((2, 3), keepdim=True),
    "maximum": lambda h: torch.maximum(h, h.flip(2)),
    "flip-roll": lambda h: h.flip(1).roll(1, 2),
    "repeat": lambda h: h.repeat(1, 2, 1, 1),
    "index-select": lambda h: h.index_select(1, torch.tensor([0, 2, 2])),
    "gather": lambda h: h.gather(
        1, torch.tensor([1, 0, 3]).view(1, 3, 1, 1).expand(len(h), 3, 2, 2)
    ),
    "im2col": lambda h: F.unfold(h, 2),
    "fold": lambda h: F.fold(F.unfold(h, 2, stride=2), (2, 2), 2, stride=2),
    "tensor-unfold": lambda h: h.unfold(2, 2, 1),
    "cumsum": lambda h: h.cumsum(1),
    "masked-fill": lambda h: h.masked_fill(h > 0.5, 0.0),
    "channel-shuffle": nn.ChannelShuffle(2),
    "diagonal": lambda h: h.diagonal(0, 2, 3),
    "prelu": nn.PReLU,
    "prelu-channelwise": lambda: nn.PReLU(4, init=0.1),
    "functional-prelu": lambda h: F.prelu(h, torch.tensor([0.2, -0.1, 0.3, 0.5], dtype=DT)),
}


class Wrapped(nn.Module):
    """``fc1 -> sigmoid -> [N, 4, 2, 2] -> op -> tanh -> fc2``."""

    def __init__(self, op):
        super().__init__()
        self.fc1 = nn.Linear(3, 16, dtype=DT)
        self.op = op.to(DT) if isinstance(op, nn.Module) else None
        self.fn = op
        with torch.no_grad():
            width = self.middle(torch.zeros(N, 3, dtype=DT)).flatten(1).shape[1]
        self.fc2 = nn.Linear(width, 3, dtype=DT)

    def middle(self, x):
        h = torch.sigmoid(self.fc1(x)).view(-1, 4, 2, 2) - 0.5
        return torch.tanh((self.op or self.fn)(h))

    def forward(self, x):
        return self.fc2(self.middle(x).flatten(1))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("op", list(SPATIAL))
def test_zero_curvature_op_matches_hessian(op, reduction, seed):
    fn, reference = SPATIAL[op] if isinstance(SPATIAL[op], tuple) else (SPATIAL[op], None)
    if op.startswith("prelu"):
        fn = fn()
    plain = Wrapped(fn)
    if op.startswith("prelu"):  # negative and positive slopes, inputs on both sides
        with torch.no_grad():
            plain.op.weight.uniform_(-0.5, 0.5)
    if reference is not None:
        reference = copy.deepcopy(plain)
        reference.fn = SPATIAL[op][1]
    x = torch.randn(N, 3, dtype=DT)
    # torch's float64 hardsigmoid backward multiplies by a float32 1/6 (relative error 3e-8)
    rtol = 1e-6 if op == "hardsigmoid" else None
    check_hessian(plain, x, reduction, torch.randint(0, 3, (N,)), reference, rtol)


class CausalLMHead(nn.Module):
    """What every Hugging Face ``*ForCausalLM`` does before ``lm_head`` (``logits_to_keep=0``):
    ``hidden[:, slice(0, None), :]`` on ``[N, T, D]``."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(3, 4)
        self.lm_head = nn.Linear(4, 5)

    def forward(self, x):
        h = torch.tanh(self.emb(x))
        return self.lm_head(h[:, slice(0, None), :]).flatten(0, 1)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_causal_lm_no_op_slice(reduction, seed):
    x = torch.randn(N, 2, 3, dtype=DT)
    target = torch.randint(0, 5, (N * 2,))
    check_hessian(CausalLMHead(), x, reduction, target)


class PReLUOnBoth(nn.Module):
    """``prelu(u, a)`` with both ``u`` and ``a`` functions of the parameters: the cross term
    ``1[u < 0] (du/dθ)(da/dθ)`` would be on the diagonal of a parameter both depend on, which
    the residual terms do not include; it must raise, not return numbers."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 5)
        self.slope = nn.Linear(1, 1)
        self.fc2 = nn.Linear(5, 3)

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(F.prelu(h, self.slope(torch.ones(1, dtype=x.dtype))))


def test_prelu_with_a_parameter_dependent_slope_raises(seed):
    model = extended_copy(PReLUOnBoth().to(DT))
    loss = curvopt.extend(nn.CrossEntropyLoss())(
        model(torch.randn(N, 4, dtype=DT)), torch.randint(0, 3, (N,))
    )
    with pytest.raises(CurvoptError), curvopt.collect(ext.DiagHessian()):
        loss.backward()
    assert_no_attributes(model)


class CheckpointedCurves(nn.Module):
    """``fc1 -> [sigmoid, gelu, silu, tanh inside a use_reentrant=False checkpoint] -> fc2``:
    curved ops whose ``phi''`` is read off their saved result (sigmoid, tanh) and off their
    saved input (gelu, silu), all inside the checkpoint; ``checkpointed`` off is the reference."""

    def __init__(self, checkpointed=True):
        super().__init__()
        self.fc1, self.mid, self.fc2 = nn.Linear(3, 5), nn.Linear(5, 5), nn.Linear(5, 3)
        self.checkpointed = checkpointed

    def block(self, h):
        h = F.gelu(self.mid(torch.sigmoid(h))) + F.silu(h)
        return torch.tanh(h)

    def forward(self, x):
        h = self.fc1(x)
        if self.checkpointed:
            h = torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=False)
        else:
            h = self.block(h)
        return self.fc2(h)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_curved_ops_inside_a_non_reentrant_checkpoint(reduction, seed):
    """curvopt reads the saved tensors of the checkpointed curved ops apart from torch's
    backward (``torch_internals.SavedTensorsApart``), which then still finds them: the diagonal
    and the gradients equal the un-checkpointed model's."""
    if torch_internals._GRAPH_EXEC_GROUP is None:
        pytest.skip("torch before 2.10 has no GraphExecGroup")
    plain = CheckpointedCurves().to(DT)
    reference = copy.deepcopy(plain)
    reference.checkpointed = False
    x, target = torch.randn(N + 2, 3, dtype=DT), torch.randint(0, 3, (N + 2,))
    check_hessian(plain, x, reduction, target, reference)
    lossfunc = nn.CrossEntropyLoss(reduction=reduction)
    model, unchecked = extended_copy(plain), copy.deepcopy(reference)
    run_second_order(model, curvopt.extend(lossfunc), x, target, ext.DiagHessian())
    lossfunc(unchecked(x), target).backward()
    for (name, p), q in zip(trainable(model).items(), trainable(unchecked).values()):
        assert_close(p.grad, q.grad, f"{name}.grad")
