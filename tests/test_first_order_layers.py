"""First-order quantities for every supported layer type, against independent references.

Each case is one layer (or a small wrapper around it) fed to ``MSELoss``; curvopt's
``grad_batch``/``batch_l2``/``sum_grad_squared``/``variance`` and ``p.grad`` are compared with
the per-sample loop reference, and ``grad_batch`` also with the ``vmap(grad)`` reference.
"""

from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    DT,
    assert_close,
    assert_first_order,
    check_against_loop,
    extended_copy,
    ggn_reference,
    per_sample_grads_loop,
    per_sample_grads_vmap,
    run_collect,
    run_second_order,
)
from torch import nn

import curvopt
import curvopt.layers.conv
from curvopt import extensions as ext
from curvopt.errors import UnsupportedModuleError

N = 3


def _x(*shape):
    return torch.randn(N, *shape, dtype=DT)


def _run_case(plain, x, reduction, in_dim=0, out_dim=0, vmap=True):
    plain = plain.to(DT)
    with torch.no_grad():
        out = plain(*(x if isinstance(x, tuple) else (x,)))
    target = torch.randn_like(out)
    lossfunc = nn.MSELoss(reduction=reduction)
    model, reference = check_against_loop(plain, lossfunc, x, target, in_dim, out_dim)
    if vmap and not isinstance(x, tuple) and in_dim == 0 and out_dim == 0:
        second = per_sample_grads_vmap(plain, lossfunc, x, target)
        for name, g in second.items():
            assert_close(reference[name], g, f"loop vs vmap reference for {name}")
    return model


# ------------------------------------------------------------------------------ Linear

LINEAR = {
    "2d": (lambda: nn.Linear(4, 3), (4,)),
    "2d-nobias": (lambda: nn.Linear(4, 3, bias=False), (4,)),
    "3d": (lambda: nn.Linear(4, 3), (5, 4)),
    "3d-T1": (lambda: nn.Linear(4, 3), (1, 4)),
    "3d-ghost": (lambda: nn.Linear(12, 10), (2, 12)),  # T (O+I) < O I: ghost-norm fast path
    "4d": (lambda: nn.Linear(4, 3), (2, 3, 4)),
    "4d-nobias": (lambda: nn.Linear(4, 2, bias=False), (3, 2, 4)),
}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("case", list(LINEAR))
def test_linear(case, reduction, seed):
    make, shape = LINEAR[case]
    _run_case(make(), _x(*shape), reduction)


# ------------------------------------------------------------------------------ convolutions

CONV = {
    "1d": (lambda: nn.Conv1d(3, 4, 3), (3, 9)),
    "1d-stride-pad": (lambda: nn.Conv1d(3, 4, 3, stride=2, padding=1), (3, 9)),
    "1d-dil-groups-same": (
        lambda: nn.Conv1d(4, 6, 3, dilation=2, groups=2, padding="same"),
        (4, 8),
    ),
    "1d-valid-nobias": (lambda: nn.Conv1d(2, 3, 4, padding="valid", bias=False), (2, 7)),
    "1d-reflect": (lambda: nn.Conv1d(2, 3, 3, padding=2, padding_mode="reflect"), (2, 7)),
    "1d-replicate": (lambda: nn.Conv1d(2, 3, 3, padding=1, padding_mode="replicate"), (2, 7)),
    "1d-circular": (lambda: nn.Conv1d(2, 3, 3, padding=2, padding_mode="circular"), (2, 7)),
    "2d": (lambda: nn.Conv2d(3, 4, 3), (3, 5, 5)),
    "2d-tuples": (
        lambda: nn.Conv2d(3, 4, (3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2)),
        (3, 7, 6),
    ),
    "2d-depthwise": (lambda: nn.Conv2d(4, 8, 3, groups=4, padding=1), (4, 5, 5)),
    "2d-groups-nobias": (lambda: nn.Conv2d(4, 6, 2, groups=2, stride=2, bias=False), (4, 6, 6)),
    "2d-same-even-kernel": (
        lambda: nn.Conv2d(2, 3, (2, 4), padding="same", dilation=(1, 2)),
        (2, 5, 7),
    ),
    "2d-valid": (lambda: nn.Conv2d(2, 3, 3, padding="valid"), (2, 5, 6)),
    "2d-reflect": (lambda: nn.Conv2d(2, 3, 3, padding=(1, 2), padding_mode="reflect"), (2, 5, 6)),
    "2d-replicate": (
        lambda: nn.Conv2d(2, 3, 3, stride=2, padding=1, padding_mode="replicate"),
        (2, 5, 6),
    ),
    "2d-circular": (
        lambda: nn.Conv2d(2, 4, 3, padding=(2, 1), padding_mode="circular", groups=2),
        (2, 5, 6),
    ),
    "2d-same-circular": (
        lambda: nn.Conv2d(2, 3, 4, padding="same", padding_mode="circular"),
        (2, 5, 6),
    ),
    "2d-big-channels": (lambda: nn.Conv2d(8, 9, 3), (8, 4, 4)),  # Gram fast path for batch_l2
    "3d": (lambda: nn.Conv3d(2, 3, 2), (2, 3, 4, 3)),
    "3d-stride-pad-groups": (
        lambda: nn.Conv3d(2, 4, (2, 3, 2), stride=(1, 2, 1), padding=(1, 1, 0), groups=2),
        (2, 3, 5, 3),
    ),
    "3d-same-dil": (
        lambda: nn.Conv3d(2, 2, 2, padding="same", dilation=2, bias=False),
        (2, 4, 4, 3),
    ),
    "3d-circular": (lambda: nn.Conv3d(1, 2, 3, padding=1, padding_mode="circular"), (1, 3, 4, 3)),
    "3d-reflect": (lambda: nn.Conv3d(1, 2, 3, padding=1, padding_mode="reflect"), (1, 3, 4, 3)),
    "3d-replicate": (lambda: nn.Conv3d(1, 2, 2, padding=1, padding_mode="replicate"), (1, 3, 3, 3)),
    "T1d": (lambda: nn.ConvTranspose1d(3, 4, 3), (3, 5)),
    "T1d-stride-pad-op": (
        lambda: nn.ConvTranspose1d(3, 4, 3, stride=2, padding=1, output_padding=1),
        (3, 5),
    ),
    "T1d-op-ge-stride": (
        lambda: nn.ConvTranspose1d(2, 3, 3, stride=2, dilation=3, output_padding=2),
        (2, 4),
    ),
    "T1d-groups-nobias": (
        lambda: nn.ConvTranspose1d(4, 6, 2, groups=2, stride=3, bias=False),
        (4, 4),
    ),
    "T2d": (lambda: nn.ConvTranspose2d(2, 3, 3), (2, 3, 4)),
    "T2d-tuples": (
        lambda: nn.ConvTranspose2d(
            2, 3, (3, 2), stride=(2, 1), padding=(1, 0), output_padding=(1, 0), dilation=(1, 2)
        ),
        (2, 3, 4),
    ),
    "T2d-op-ge-stride": (
        lambda: nn.ConvTranspose2d(2, 2, 3, stride=(1, 2), dilation=(2, 3), output_padding=(1, 2)),
        (2, 3, 3),
    ),
    "T2d-groups": (lambda: nn.ConvTranspose2d(4, 4, 3, groups=4, stride=2, padding=1), (4, 3, 3)),
    "T3d": (lambda: nn.ConvTranspose3d(2, 2, 2, stride=2), (2, 2, 3, 2)),
    "T3d-pad-groups-op": (
        lambda: nn.ConvTranspose3d(
            2, 4, (2, 3, 2), stride=(2, 1, 2), padding=(0, 1, 1), output_padding=(1, 0, 1), groups=2
        ),
        (2, 2, 3, 2),
    ),
    "T3d-op-ge-stride": (
        lambda: nn.ConvTranspose3d(1, 2, 2, stride=1, dilation=2, output_padding=1, bias=False),
        (1, 2, 3, 2),
    ),
}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("case", list(CONV))
def test_conv(case, reduction, seed):
    make, shape = CONV[case]
    _run_case(make(), _x(*shape), reduction)


@pytest.mark.parametrize("case", [c for c in CONV if not c.startswith("T")])
def test_conv_per_sample_grads_by_grouped_convolution(case, monkeypatch, seed):
    """The grouped-convolution kernel (samples as groups), forced on for small layers."""
    monkeypatch.setattr(curvopt.layers.conv, "_GROUPED_MIN_CHANNELS", 1)
    make, shape = CONV[case]
    _run_case(make(), _x(*shape), "mean")


class _TransposeWithOutputSize(nn.Module):
    """A transposed convolution called with ``output_size`` (dynamic output padding)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.ConvTranspose2d(2, 3, 3, stride=3, padding=1)

    def forward(self, x):
        return self.conv(x, output_size=[3 * x.shape[2] - 1 + 1, 3 * x.shape[3]])


def test_conv_transpose_output_size(seed):
    _run_case(_TransposeWithOutputSize(), _x(2, 3, 2), "sum")


# ------------------------------------------------------------------------------ Embedding


class _Tokens(nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.emb = nn.Embedding(7, 3, **kwargs)

    def forward(self, idx):
        return self.emb(idx)


EMBEDDING = {
    "seq": ({}, lambda: torch.randint(0, 7, (N, 5))),
    "repeated": ({}, lambda: torch.tensor([[1, 1, 1, 2], [3, 4, 3, 3], [6, 6, 0, 1]])),
    "padding-idx": (
        {"padding_idx": 1},
        lambda: torch.tensor([[1, 1, 2, 0], [1, 4, 4, 3], [5, 1, 6, 6]]),
    ),
    "one-token": ({}, lambda: torch.tensor([2, 2, 5])),
    "2d-tokens": ({"padding_idx": 0}, lambda: torch.randint(0, 7, (N, 2, 3))),
}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("case", list(EMBEDDING))
def test_embedding(case, reduction, seed):
    kwargs, idx = EMBEDDING[case]
    model = _run_case(_Tokens(**kwargs), idx(), reduction)
    if "padding_idx" in kwargs:
        pad = kwargs["padding_idx"]
        assert model.emb.weight.sum_grad_squared[pad].abs().max() == 0


def test_embedding_scale_grad_by_freq_is_rejected(seed):
    model = extended_copy(_Tokens(scale_grad_by_freq=True).to(DT))
    idx = torch.tensor([[1, 1, 2], [3, 4, 4]])
    loss = model(idx).pow(2).sum()
    with pytest.raises(UnsupportedModuleError, match="scale_grad_by_freq") as info:
        with curvopt.collect(ext.BatchGrad()):
            loss.backward()
    assert "emb" in str(info.value)
    assert not hasattr(model.emb.weight, "grad_batch")


# ------------------------------------------------------------------------------ normalisation


def _bn_eval(bn):
    """A BatchNorm in eval mode with non-trivial running statistics and affine parameters."""
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        if bn.weight is not None:
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-1, 1)
    return bn.eval()


def _randomise_affine(module):
    with torch.no_grad():
        for p in module.parameters():
            p.uniform_(0.5, 1.5)
    return module


NORM = {
    "layernorm": (lambda: nn.LayerNorm(4), (5, 4)),
    "layernorm-2d-input": (lambda: nn.LayerNorm(4), (4,)),
    "layernorm-multidim": (lambda: nn.LayerNorm([3, 4]), (2, 3, 4)),
    "layernorm-nobias": (lambda: nn.LayerNorm([2, 3], bias=False), (2, 3)),
    "rmsnorm": (lambda: nn.RMSNorm(4), (5, 4)),
    "rmsnorm-multidim-eps": (lambda: nn.RMSNorm([2, 3], eps=1e-3), (2, 2, 3)),
    "groupnorm-1d": (lambda: nn.GroupNorm(2, 4), (4, 5)),
    "groupnorm-2d": (lambda: nn.GroupNorm(3, 6), (6, 2, 3)),
    "groupnorm-channels": (lambda: nn.GroupNorm(1, 3), (3,)),
    "batchnorm1d-2d-input": (lambda: _bn_eval(nn.BatchNorm1d(4)), (4,)),
    "batchnorm1d-3d-input": (lambda: _bn_eval(nn.BatchNorm1d(3)), (3, 5)),
    "batchnorm2d": (lambda: _bn_eval(nn.BatchNorm2d(3)), (3, 2, 3)),
    "batchnorm3d": (lambda: _bn_eval(nn.BatchNorm3d(2)), (2, 2, 2, 3)),
    # training mode with running statistics: normalised per sample, the statistics only updated
    "instancenorm1d-running-train": (
        lambda: nn.InstanceNorm1d(3, affine=True, track_running_stats=True), (3, 5)
    ),
    "instancenorm2d-running-train": (
        lambda: nn.InstanceNorm2d(2, affine=True, track_running_stats=True), (2, 3, 4)
    ),
    "instancenorm3d-running-train": (
        lambda: nn.InstanceNorm3d(2, affine=True, track_running_stats=True, momentum=0.3),
        (2, 2, 3, 2),
    ),
    "instancenorm2d-running-eval": (
        lambda: _bn_eval(nn.InstanceNorm2d(2, affine=True, track_running_stats=True)),
        (2, 3, 3),
    ),
    "instancenorm2d": (lambda: nn.InstanceNorm2d(3, affine=True), (3, 2, 3)),
}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("case", list(NORM))
def test_norm(case, reduction, seed):
    make, shape = NORM[case]
    module = make()
    if not case.startswith("batchnorm"):
        _randomise_affine(module)
    # vmap cannot run a module that updates running statistics (the loop reference can)
    _run_case(module, _x(*shape) * 2 + 0.5, reduction, vmap="running-train" not in case)


def test_instancenorm_running_statistics_are_updated_once_per_forward(seed):
    """The rule never re-runs the module: after a collect pass the running statistics are
    those of one forward of the plain model."""
    norm = nn.InstanceNorm2d(3, affine=True, track_running_stats=True)
    plain = nn.Sequential(nn.Conv2d(2, 3, 2), norm).to(DT)
    model = extended_copy(plain)
    x = _x(2, 4, 4)
    loss = model(x).square().sum()
    with curvopt.collect(ext.BatchGrad(), ext.Variance()):
        loss.backward()
    with torch.no_grad():
        plain(x)
    assert_close(model[1].running_mean, plain[1].running_mean, "running_mean")
    assert_close(model[1].running_var, plain[1].running_var, "running_var")


def test_instancenorm_running_train_ggn_diagonals(seed):
    """Second order through the same rule (GGN columns as pseudo-samples)."""
    plain = nn.Sequential(
        nn.Conv2d(2, 3, 2), nn.InstanceNorm2d(3, affine=True, track_running_stats=True),
        nn.Tanh(), nn.Flatten(), nn.Linear(27, 3),
    ).to(DT)
    _randomise_affine(plain[1])
    x, y = _x(2, 4, 4), torch.randint(0, 3, (N,))
    model = extended_copy(plain)
    blocks, per_sample = ggn_reference(plain, nn.CrossEntropyLoss(), x, y)
    run_second_order(
        model, curvopt.extend(nn.CrossEntropyLoss()), x, y,
        ext.DiagGGNExact(), ext.BatchDiagGGNExact(),
    )
    for name, p in model.named_parameters():
        assert_close(p.diag_ggn_exact, torch.diagonal(blocks[name]).reshape(p.shape), name)
        assert_close(p.diag_ggn_exact_batch, per_sample[name], name)


class _WithInstanceNorm(nn.Module):
    """A parameter of its own (so the generic rule re-runs it) around a tracking InstanceNorm."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(2, 1, 1))
        self.norm = nn.InstanceNorm2d(2, track_running_stats=True)

    def forward(self, x):
        return self.norm(x * self.scale)


def test_generic_module_with_tracking_instancenorm_names_the_fix(seed):
    model = extended_copy(nn.Sequential(_WithInstanceNorm(), nn.Flatten(), nn.Linear(18, 2)).to(DT))
    loss = model(_x(2, 3, 3)).square().sum()
    with pytest.raises(UnsupportedModuleError, match="track_running_stats=False"):
        with curvopt.collect(ext.BatchGrad()):
            loss.backward()
    model.eval()
    loss = model(_x(2, 3, 3)).square().sum()
    with curvopt.collect(ext.BatchGrad()):
        loss.backward()
    assert model[0].scale.grad_batch.shape == (N, 2, 1, 1)


def _bn_model(**kwargs):
    return nn.Sequential(
        OrderedDict(
            fc=nn.Linear(4, 3), block=nn.Sequential(OrderedDict(bn=nn.BatchNorm1d(3, **kwargs)))
        )
    ).to(DT)


@pytest.mark.parametrize(
    "kwargs, mode",
    [
        ({}, "train"),
        ({"track_running_stats": False}, "eval"),
        ({"track_running_stats": False}, "train"),
    ],
)
def test_batchnorm_batch_statistics_are_rejected(kwargs, mode, seed):
    model = extended_copy(_bn_model(**kwargs))
    model.train(mode == "train")
    loss = model(_x(4)).pow(2).sum()
    with pytest.raises(UnsupportedModuleError) as info:
        with curvopt.collect(ext.BatchGrad(), ext.Variance()):
            loss.backward()
    message = str(info.value)
    assert "block.bn" in message and "BatchNorm1d" in message and "eval" in message
    for p in model.parameters():
        assert not hasattr(p, "grad_batch") and not hasattr(p, "variance")


def test_batchnorm_error_without_batch_grad(seed):
    """Only reduced quantities requested: still an error, not numbers."""
    model = extended_copy(_bn_model())
    model.train()
    loss = model(_x(4)).pow(2).sum()
    with pytest.raises(UnsupportedModuleError, match="block.bn"):
        with curvopt.collect(ext.BatchL2Grad()):
            loss.backward()


# ------------------------------------------------------------------------------ attention


class _SelfAttention(nn.Module):
    def __init__(self, batch_first, **kwargs):
        super().__init__()
        self.mha = nn.MultiheadAttention(4, 2, batch_first=batch_first, **kwargs)

    def forward(self, x, mask=None):
        return self.mha(x, x, x, key_padding_mask=mask)[0]


class _CrossAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(4, 2, kdim=3, vdim=5, batch_first=True)

    def forward(self, q, k, v):
        out, weights = self.mha(q, k, v)
        return out + weights.sum(-1, keepdim=True)  # the attention weights reach the loss too


def _mask(n, s):
    mask = torch.zeros(n, s, dtype=torch.bool)
    mask[0, -2:] = True
    if n > 1:
        mask[-1, 0] = True
    return mask


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("masked", [False, True])
def test_multihead_attention(batch_first, masked, reduction, seed):
    length = 5
    x = _x(length, 4) if batch_first else torch.randn(length, N, 4, dtype=DT)
    inputs = (x, _mask(N, length)) if masked else x
    dim = 0 if batch_first else 1
    in_dim = (dim, 0) if masked else dim
    plain = _SelfAttention(batch_first).to(DT)
    target = torch.randn_like(x)
    check_against_loop(plain, nn.MSELoss(reduction=reduction), inputs, target, in_dim, dim)


@pytest.mark.parametrize("variant", ["bias_kv", "no_bias"])
def test_multihead_attention_variants(variant, seed):
    kwargs = {"add_bias_kv": True} if variant == "bias_kv" else {"bias": False}
    plain = _SelfAttention(True, **kwargs).to(DT)
    x = _x(4, 4)
    check_against_loop(plain, nn.MSELoss(), x, torch.randn_like(x))


def test_multihead_attention_cross_with_weights(seed):
    plain = _CrossAttention().to(DT)
    inputs = (_x(2, 4), _x(3, 3), _x(3, 5))
    check_against_loop(plain, nn.MSELoss(reduction="sum"), inputs, torch.randn(N, 2, 4, dtype=DT))


class _SquareMaskAttention(nn.Module):
    """Causal ``attn_mask`` of shape ``[L, L]`` with ``L == N``: a mask shared by all samples."""

    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(4, 1, batch_first=True)

    def forward(self, x):
        length = x.shape[1]
        mask = torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)
        return self.mha(x, x, x, attn_mask=mask, need_weights=False)[0]


def test_multihead_attention_shared_mask_with_length_equal_to_batch(seed):
    plain = _SquareMaskAttention().to(DT)
    x = _x(N, 4)  # sequence length == batch size
    check_against_loop(plain, nn.MSELoss(), x, torch.randn_like(x))


# ------------------------------------------------------------------------------ raw parameters


class _ScaleShift(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = nn.Parameter(torch.rand(dim) + 0.5)
        self.shift = nn.Parameter(torch.randn(dim))

    def forward(self, x):
        return x * self.scale + self.shift


class _RawAndChildren(nn.Module):
    """Owns a raw parameter and child modules, and mixes them in its forward."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Parameter(torch.randn(3))
        self.fc1 = nn.Linear(4, 3)
        self.act = nn.Tanh()
        self.fc2 = nn.Linear(3, 2)

    def forward(self, x):
        h = self.act(self.fc1(x)) * self.gate
        return self.fc2(h) + self.gate[:2] ** 2


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_raw_parameter_module(reduction, seed):
    _run_case(_ScaleShift(4), _x(5, 4), reduction)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_raw_parameter_with_children(reduction, seed):
    _run_case(_RawAndChildren(), _x(4), reduction)


def test_every_attribute_alone(seed):
    """Each extension on its own (a mixed model: Linear, Conv, norm, embedding, generic)."""

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(6, 4)
            self.conv = nn.Conv1d(4, 4, 3, padding=1)
            self.norm = nn.LayerNorm(4)
            self.scale = _ScaleShift(4)
            self.fc = nn.Linear(4, 2)

        def forward(self, idx):
            h = self.emb(idx).transpose(1, 2)
            h = self.conv(h).transpose(1, 2)
            return self.fc(self.scale(self.norm(h))).mean(1)

    plain = Mixed().to(DT)
    idx = torch.randint(0, 6, (N, 5))
    y = torch.randint(0, 2, (N,))
    attr_sets = [(a,) for a in ("grad_batch", "batch_l2", "sum_grad_squared", "variance")]
    check_against_loop(plain, nn.CrossEntropyLoss(), idx, y, attr_sets=attr_sets)


def test_chunked_reduction(monkeypatch, seed):
    """Reduced quantities without a fast path are computed in chunks of samples."""
    import curvopt.engine.reducer

    monkeypatch.setattr(curvopt.engine.reducer, "_CHUNK_ELEMENTS", 50)
    plain = nn.Sequential(nn.Conv2d(2, 3, 3, groups=1), nn.Flatten(), nn.Linear(6, 2)).to(DT)
    x = torch.randn(7, 2, 4, 3, dtype=DT)
    check_against_loop(
        plain,
        nn.MSELoss(),
        x,
        torch.randn(7, 2, dtype=DT),
        attr_sets=[("batch_l2", "sum_grad_squared", "variance")],
    )


def test_run_collect_smoke(seed):
    """The helper itself: attributes for requested extensions only."""
    model = extended_copy(nn.Linear(2, 2).to(DT))
    run_collect(model, nn.MSELoss(), _x(2), _x(2), ("batch_l2",))
    assert model.weight.batch_l2.shape == (N,)
    assert not hasattr(model.weight, "grad_batch")


# ------------------------------------------------------------------------------ generic fallback


class _Bilinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.bil = nn.Bilinear(3, 2, 4)

    def forward(self, x):
        return self.bil(x, x[:, :2] ** 2)


class _LSTMCellLoop(nn.Module):
    """A cell unrolled over time: one module called T times, two dependent outputs (h, c)."""

    def __init__(self, steps, use):
        super().__init__()
        self.cell = nn.LSTMCell(3, 4)
        self.steps, self.use = steps, use

    def forward(self, x):
        state = (
            torch.zeros(x.shape[0], 4, dtype=x.dtype),
            torch.zeros(x.shape[0], 4, dtype=x.dtype),
        )
        for t in range(self.steps):
            state = self.cell(x[:, t], state)
        h, c = state
        return {"h": h, "hc": h + 0.5 * c, "c": c}[self.use]


class _DependentOutputs(nn.Module):
    """Returns ``(y, z)`` with ``z`` computed from ``y``, and an integer tensor first."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))
        self.v = nn.Parameter(torch.randn(4))

    def forward(self, x):
        y = torch.tanh(x * self.w)
        z = y * self.v + y**2
        return x.argmax(-1), y, z


class _UsesDependent(nn.Module):
    def __init__(self, use):
        super().__init__()
        self.inner = _DependentOutputs()
        self.use = use

    def forward(self, x):
        _, y, z = self.inner(x)
        return {"y": y, "z": z, "yz": y * 2 + z.sin()}[self.use]


GENERIC = {
    "prelu": (lambda: nn.PReLU(3), (3, 4)),
    "bilinear": (_Bilinear, (3,)),
    "instancenorm": (lambda: nn.InstanceNorm2d(3, affine=True), (3, 3, 3)),
    "instancenorm-running-eval": (
        lambda: nn.InstanceNorm1d(3, affine=True, track_running_stats=True).eval(),
        (3, 5),
    ),
    "lstmcell-h": (lambda: _LSTMCellLoop(3, "h"), (3, 3)),
    "lstmcell-hc": (lambda: _LSTMCellLoop(2, "hc"), (3, 3)),
    "dependent-y": (lambda: _UsesDependent("y"), (4,)),
    "dependent-z": (lambda: _UsesDependent("z"), (4,)),
    "dependent-yz": (lambda: _UsesDependent("yz"), (2, 4)),
    "transformer-layer": (
        lambda: nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True),
        (5, 4),
    ),
    "transformer-layer-norm-first": (
        lambda: nn.TransformerEncoderLayer(4, 2, 6, dropout=0.0, batch_first=True, norm_first=True),
        (3, 4),
    ),
}


@pytest.mark.parametrize("case", list(GENERIC))
def test_generic_modules(case, seed):
    make, shape = GENERIC[case]
    _run_case(make(), _x(*shape), "mean", vmap=False)


def test_embedding_bag(seed):
    _run_case(nn.EmbeddingBag(7, 3, mode="mean"), torch.randint(0, 7, (N, 4)), "sum")


def test_generic_only_second_output_used(seed):
    _run_case(_LSTMCellLoop(2, "c"), _x(3, 3), "sum", vmap=False)


def test_dropout_in_generic_module_uses_the_forwards_mask(seed):
    """The generic rule re-runs ``x * scale`` with the mask the forward drew: ``g_n`` is
    ``2 y_n * m_n * x_n`` for the output ``y = m * x * scale`` (``m`` the scaled mask)."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(3) + torch.arange(3.0) / 10)
            self.drop = nn.Dropout(0.5)

        def forward(self, x):
            return self.drop(x * self.scale)

    model = extended_copy(Net().to(DT)).train()
    x = _x(3)
    state = torch.get_rng_state()
    out = model(x)
    with curvopt.collect(ext.BatchGrad()):
        out.pow(2).sum().backward()
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(state)
        mask = F.dropout(torch.ones_like(x), 0.5, True)
    assert 0 < int((mask == 0).sum()) < mask.numel()
    assert_close(model.scale.grad_batch, 2 * out.detach() * mask * x, "scale")


class _PerSampleMaskAttention(nn.Module):
    """A 3-D float ``attn_mask`` ``[N * heads, L, S]``: one additive mask per sample and head."""

    def __init__(self, batch_first):
        super().__init__()
        self.mha = nn.MultiheadAttention(4, 2, batch_first=batch_first)

    def forward(self, x, mask):
        return self.mha(x, x, x, attn_mask=mask, need_weights=False)[0]


def _mask3d_reference(plain, x, mask, target, dim):
    """Loop reference for :class:`_PerSampleMaskAttention`: the mask split per sample as
    ``[N, heads, L, S] -> [heads, L, S]``."""

    class Ref(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = plain.mha

        def forward(self, x, mask4):
            return self.mha(x, x, x, attn_mask=mask4.flatten(0, 1), need_weights=False)[0]

    heads = plain.mha.num_heads
    mask4 = mask.view(-1, heads, *mask.shape[1:])
    return per_sample_grads_loop(Ref(), nn.MSELoss(), (x, mask4), target, (dim, 0), dim)


@pytest.mark.parametrize("batch_first", [True, False])
def test_multihead_attention_per_sample_3d_mask(batch_first, seed):
    length = 4
    x = _x(length, 4) if batch_first else torch.randn(length, N, 4, dtype=DT)
    mask = torch.randn(N * 2, length, length, dtype=DT)
    dim = 0 if batch_first else 1
    target = torch.randn_like(x)
    plain = _PerSampleMaskAttention(batch_first).to(DT)
    reference = _mask3d_reference(plain, x, mask, target, dim)
    model = extended_copy(plain)
    for attrs in [("grad_batch",), ("batch_l2", "sum_grad_squared", "variance")]:
        run_collect(model, nn.MSELoss(), (x, mask), target, attrs)
        assert_first_order(model, reference, attrs)


@pytest.mark.parametrize(
    "case",
    ["mha-seq-first-masked", "mha-causal-L-equals-N", "mha-3d-mask", "dependent-yz", "prelu"],
)
def test_generic_reductions_in_chunks(case, monkeypatch, seed):
    """Reduced quantities of generic modules are computed chunk by chunk of samples, split with
    the rule's knowledge of which inputs are per-sample (masks included)."""
    import curvopt.engine.reducer
    import curvopt.layers.generic

    monkeypatch.setattr(curvopt.layers.generic, "_CHUNK_ELEMENTS", 40)
    monkeypatch.setattr(curvopt.engine.reducer, "_CHUNK_ELEMENTS", 40)
    reduced = [("batch_l2", "sum_grad_squared", "variance"), ("variance",)]
    n = 4
    if case == "mha-seq-first-masked":
        x = torch.randn(5, n, 4, dtype=DT)
        mask = torch.zeros(n, 5, dtype=torch.bool)
        mask[0, -2:] = True
        mask[-1, 0] = True
        check_against_loop(
            _SelfAttention(False).to(DT),
            nn.MSELoss(),
            (x, mask),
            torch.randn_like(x),
            (1, 0),
            1,
            attr_sets=reduced,
        )
    elif case == "mha-causal-L-equals-N":
        x = torch.randn(n, n, 4, dtype=DT)
        check_against_loop(
            _SquareMaskAttention().to(DT), nn.MSELoss(), x, torch.randn_like(x), attr_sets=reduced
        )
    elif case == "mha-3d-mask":
        plain = _PerSampleMaskAttention(True).to(DT)
        x, mask = torch.randn(n, 3, 4, dtype=DT), torch.randn(n * 2, 3, 3, dtype=DT)
        target = torch.randn_like(x)
        reference = _mask3d_reference(plain, x, mask, target, 0)
        model = extended_copy(plain)
        for attrs in reduced:
            run_collect(model, nn.MSELoss(), (x, mask), target, attrs)
            assert_first_order(model, reference, attrs)
    else:
        make, shape = GENERIC[case]
        x = torch.randn(n, *shape, dtype=DT)
        plain = make().to(DT)
        with torch.no_grad():
            out = plain(x)
        check_against_loop(plain, nn.MSELoss(), x, torch.randn_like(out), attr_sets=reduced)


def test_conv_channels_last(seed):
    x = _x(3, 5, 5).to(memory_format=torch.channels_last)
    _run_case(nn.Conv2d(3, 4, 3, padding=1, groups=1), x, "mean")


def test_embedding_max_norm(seed):
    _run_case(_Tokens(max_norm=0.5), torch.randint(0, 7, (N, 4)), "sum", vmap=False)


def test_embedding_sparse_gradients(seed):
    plain = _Tokens().to(DT)
    model = extended_copy(plain)
    model.emb.sparse = True
    idx = torch.randint(0, 7, (N, 4))
    target = torch.randn(N, 4, 3, dtype=DT)
    reference = per_sample_grads_loop(plain, nn.MSELoss(), idx, target)
    run_collect(model, nn.MSELoss(), idx, target)
    assert model.emb.weight.grad.is_sparse
    model.emb.weight.grad = model.emb.weight.grad.to_dense()
    assert_first_order(model, reference)
