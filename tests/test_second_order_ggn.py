"""Exact GGN diagonals (``DiagGGNExact``, ``BatchDiagGGNExact``) against ``J^T H J`` built with
``torch.func`` (``jacrev`` of the model output, ``hessian`` of the loss w.r.t. the output).

Every layer type x every supported loss x both reductions, ``N = 1``, and small architectures
(MLP, CNN, residual, transformer-style block, a module called twice).
"""

import pytest
import torch
from conftest import DT, assert_close, extended_copy, ggn_reference, run_second_order, trainable
from torch import nn

import curvopt
from curvopt import extensions as ext

N = 3


# ------------------------------------------------------------------------------ helpers


def make_target(loss_name, out, sample_dim=0):
    """A target for ``out`` (``[N, *F]``); CE treats dim 1 as classes, further dims as positions."""
    if loss_name == "ce":
        shape = list(out.shape)
        classes = shape.pop(1)
        return torch.randint(0, classes, shape)
    if loss_name == "mse":
        return torch.randn_like(out)
    return torch.rand_like(out)


LOSSES = {
    "ce": nn.CrossEntropyLoss,
    "mse": nn.MSELoss,
    "bce": nn.BCEWithLogitsLoss,
}


def check_ggn(plain, inputs, loss_name, reduction, out_dim=0, target=None):
    """DiagGGNExact and BatchDiagGGNExact of an extended copy equal the reference."""
    plain = plain.to(DT)
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    with torch.no_grad():
        out = plain(*inputs)
    if target is None:
        target = make_target(loss_name, out)
    lossfunc = LOSSES[loss_name](reduction=reduction)
    blocks, per_sample = ggn_reference(plain, lossfunc, inputs, target, out_dim)
    model = extended_copy(plain)
    run_second_order(
        model,
        curvopt.extend(LOSSES[loss_name](reduction=reduction)),
        inputs,
        target,
        ext.DiagGGNExact(),
        ext.BatchDiagGGNExact(),
    )
    params = trainable(model)
    assert set(params) == set(blocks)
    nonzero = 0.0
    for name, p in params.items():
        diag = torch.diagonal(blocks[name]).reshape(p.shape)
        assert_close(p.diag_ggn_exact, diag, f"{name}.diag_ggn_exact")
        assert_close(p.diag_ggn_exact_batch, per_sample[name], f"{name}.diag_ggn_exact_batch")
        assert_close(p.diag_ggn_exact_batch.sum(0), p.diag_ggn_exact, f"{name}: batch terms sum")
        nonzero = max(nonzero, diag.abs().max().item())
    assert nonzero > 0, "degenerate case: the reference GGN diagonal is zero"
    return model


def _x(*shape, n=N):
    return torch.randn(n, *shape, dtype=DT)


# ------------------------------------------------------------------------------ layers


def _bn_eval(bn):
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-1, 1)
    return bn.eval()


def _affine(module):
    with torch.no_grad():
        for p in module.parameters():
            p.uniform_(0.5, 1.5)
    return module


class SelfAttention(nn.Module):
    """``[N, L, E] -> [N, L, E]`` whatever ``batch_first`` (transposed around the attention)."""

    def __init__(self, batch_first, **kwargs):
        super().__init__()
        self.batch_first = batch_first
        self.mha = nn.MultiheadAttention(4, 2, batch_first=batch_first, **kwargs)

    def forward(self, x):
        if not self.batch_first:
            x = x.transpose(0, 1)
        out = self.mha(x, x, x, need_weights=False)[0]
        return out if self.batch_first else out.transpose(0, 1)


class RawParameter(nn.Module):
    """A user module whose forward uses raw parameters nonlinearly."""

    def __init__(self, dim):
        super().__init__()
        self.scale = nn.Parameter(torch.rand(dim) + 0.5)
        self.shift = nn.Parameter(torch.randn(dim))

    def forward(self, x):
        return torch.tanh(x * self.scale) + self.shift**2


class Tokens(nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.emb = nn.Embedding(7, 3, **kwargs)

    def forward(self, idx):
        return self.emb(idx)


def _tokens(n=N):
    return torch.randint(0, 7, (n, 4))


#: name -> (module factory, input factory taking n)
LAYERS = {
    "linear-2d": (lambda: nn.Linear(4, 3), lambda n: _x(4, n=n)),
    "linear-3d": (lambda: nn.Linear(4, 3), lambda n: _x(5, 4, n=n)),
    "linear-4d-nobias": (lambda: nn.Linear(4, 2, bias=False), lambda n: _x(2, 3, 4, n=n)),
    "conv1d-stride-pad": (lambda: nn.Conv1d(2, 3, 3, stride=2, padding=1), lambda n: _x(2, 7, n=n)),
    "conv1d-same-dil": (
        lambda: nn.Conv1d(2, 3, 3, padding="same", dilation=2),
        lambda n: _x(2, 6, n=n),
    ),
    "conv2d-groups": (lambda: nn.Conv2d(4, 4, 3, groups=2, padding=1), lambda n: _x(4, 3, 3, n=n)),
    "conv2d-stride-dil": (
        lambda: nn.Conv2d(2, 3, (2, 3), stride=(2, 1), dilation=(1, 2)),
        lambda n: _x(2, 5, 6, n=n),
    ),
    "conv2d-reflect": (
        lambda: nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect", bias=False),
        lambda n: _x(2, 3, 4, n=n),
    ),
    "conv3d": (lambda: nn.Conv3d(2, 2, 2, stride=2, padding=1), lambda n: _x(2, 3, 3, 2, n=n)),
    "convT1d": (
        lambda: nn.ConvTranspose1d(2, 3, 3, stride=2, padding=1, output_padding=1),
        lambda n: _x(2, 4, n=n),
    ),
    "convT2d-groups": (
        lambda: nn.ConvTranspose2d(4, 2, 3, groups=2, stride=2),
        lambda n: _x(4, 2, 2, n=n),
    ),
    "embedding": (lambda: Tokens(padding_idx=0), _tokens),
    "layernorm": (lambda: _affine(nn.LayerNorm(4)), lambda n: _x(3, 4, n=n)),
    "layernorm-2d": (lambda: _affine(nn.LayerNorm(4)), lambda n: _x(4, n=n)),
    "groupnorm": (lambda: _affine(nn.GroupNorm(2, 4)), lambda n: _x(4, 3, n=n)),
    "groupnorm-2d": (lambda: _affine(nn.GroupNorm(2, 4)), lambda n: _x(4, n=n)),
    "batchnorm1d-eval-2d": (lambda: _bn_eval(nn.BatchNorm1d(3)), lambda n: _x(3, n=n)),
    "batchnorm-eval": (lambda: _bn_eval(nn.BatchNorm2d(3)), lambda n: _x(3, 2, 2, n=n)),
    "mha-batch-first": (lambda: SelfAttention(True), lambda n: _x(3, 4, n=n)),
    "mha-seq-first": (lambda: SelfAttention(False), lambda n: _x(3, 4, n=n)),
    "raw-parameter": (lambda: RawParameter(4), lambda n: _x(2, 4, n=n)),
}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("loss_name", list(LOSSES))
@pytest.mark.parametrize("case", list(LAYERS))
def test_layer(case, loss_name, reduction, seed):
    make, inputs = LAYERS[case]
    check_ggn(make(), inputs(N), loss_name, reduction)


@pytest.mark.parametrize("case", list(LAYERS))
def test_layer_single_sample(case, seed):
    make, inputs = LAYERS[case]
    check_ggn(make(), inputs(1), "ce", "mean")


def test_cross_entropy_spatial_with_weights_and_ignore_index(seed):
    """``[N, C, d]`` logits, class weights and an ignored position (mean over kept weight)."""
    plain = nn.Conv1d(2, 4, 3, padding=1)
    x = _x(2, 5)
    target = torch.randint(0, 4, (N, 5))
    target[0, 1] = -100
    loss = nn.CrossEntropyLoss(weight=torch.tensor([0.5, 1.0, 2.0, 1.5], dtype=DT))
    blocks, per_sample = ggn_reference(plain.to(DT), loss, x, target)
    model = extended_copy(plain)
    run_second_order(
        model, curvopt.extend(loss), x, target, ext.DiagGGNExact(), ext.BatchDiagGGNExact()
    )
    for name, p in trainable(model).items():
        assert_close(p.diag_ggn_exact, torch.diagonal(blocks[name]).reshape(p.shape), name)
        assert_close(p.diag_ggn_exact_batch, per_sample[name], name)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_bce_with_weight_and_pos_weight(reduction, seed):
    plain = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 3)).to(DT)
    x = _x(4)
    target = torch.rand(N, 3, dtype=DT)
    loss = nn.BCEWithLogitsLoss(
        weight=torch.tensor([0.5, 1.0, 2.0], dtype=DT),
        pos_weight=torch.tensor([3.0, 0.5, 1.0], dtype=DT),
        reduction=reduction,
    )
    blocks, per_sample = ggn_reference(plain, loss, x, target)
    model = extended_copy(plain)
    run_second_order(
        model, curvopt.extend(loss), x, target, ext.DiagGGNExact(), ext.BatchDiagGGNExact()
    )
    for name, p in trainable(model).items():
        assert_close(p.diag_ggn_exact, torch.diagonal(blocks[name]).reshape(p.shape), name)
        assert_close(p.diag_ggn_exact_batch, per_sample[name], name)


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_cross_entropy_probability_targets(smoothing, seed):
    plain = nn.Sequential(nn.Linear(4, 3), nn.Sigmoid(), nn.Linear(3, 3)).to(DT)
    x = _x(4)
    target = torch.rand(N, 3, dtype=DT).softmax(1)
    loss = nn.CrossEntropyLoss(label_smoothing=smoothing)
    blocks, per_sample = ggn_reference(plain, loss, x, target)
    model = extended_copy(plain)
    run_second_order(
        model, curvopt.extend(loss), x, target, ext.DiagGGNExact(), ext.BatchDiagGGNExact()
    )
    for name, p in trainable(model).items():
        assert_close(p.diag_ggn_exact, torch.diagonal(blocks[name]).reshape(p.shape), name)
        assert_close(p.diag_ggn_exact_batch, per_sample[name], name)


# ------------------------------------------------------------------------------ architectures


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 5)
        self.fc1 = nn.Linear(5, 5)
        self.act = nn.Tanh()
        self.fc2 = nn.Linear(5, 5)
        self.out = nn.Linear(5, 3)

    def forward(self, x):
        h = self.inp(x)
        h = h + self.fc2(self.act(self.fc1(h)))
        return self.out(torch.relu(h))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + MHA(LN(x))``, ``x + MLP(LN(x))``, head; logits ``[N, C, L]``."""

    def __init__(self, dim=4, classes=3):
        super().__init__()
        self.ln1 = _affine(nn.LayerNorm(dim))
        self.mha = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.ln2 = _affine(nn.LayerNorm(dim))
        self.mlp = nn.Sequential(nn.Linear(dim, 6), nn.GELU(), nn.Linear(6, dim))
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.mha(h, h, h, need_weights=False)[0]
        x = x + self.mlp(self.ln2(x))
        return self.head(x).transpose(1, 2)


class Twice(nn.Module):
    """The same Linear called twice (weight sharing across depth)."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.shared(torch.tanh(self.shared(x))))


class Tied(nn.Module):
    """Embedding weight tied to the output projection (two modules share one parameter)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(5, 3)
        self.mix = nn.Linear(3, 3)
        self.out = nn.Linear(3, 5, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, idx):
        return self.out(torch.tanh(self.mix(self.emb(idx)))).transpose(1, 2)


def _mlp():
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 5), nn.Sigmoid(), nn.Linear(5, 3))


def _cnn():
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(3, 4, 2),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(4, 3),
    )


ARCHITECTURES = {
    "mlp": (_mlp, lambda n: _x(4, n=n)),
    "cnn": (_cnn, lambda n: _x(2, 4, 4, n=n)),
    "residual": (Residual, lambda n: _x(4, n=n)),
    "transformer": (TransformerBlock, lambda n: _x(3, 4, n=n)),
    "twice": (Twice, lambda n: _x(4, n=n)),
    "tied": (Tied, lambda n: torch.randint(0, 5, (n, 3))),
}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("loss_name", list(LOSSES))
@pytest.mark.parametrize("case", list(ARCHITECTURES))
def test_architecture(case, loss_name, reduction, seed):
    make, inputs = ARCHITECTURES[case]
    check_ggn(make(), inputs(N), loss_name, reduction)


@pytest.mark.parametrize("case", list(ARCHITECTURES))
def test_architecture_single_sample(case, seed):
    make, inputs = ARCHITECTURES[case]
    check_ggn(make(), inputs(1), "mse", "sum")


@pytest.mark.parametrize("case", ["layernorm-2d", "batchnorm1d-eval-2d"])
def test_norm_bias_each_quantity_alone(case, seed):
    """The 2-D norm cases (a bias gradient that is the output gradient itself) with one quantity
    per pass; ``test_layer`` has them with two quantities sharing the propagated columns."""
    make, inputs = LAYERS[case]
    plain = make().to(DT)
    x = inputs(N)
    target = torch.randint(0, 4 if case.startswith("layer") else 3, (N,))
    blocks, per_sample = ggn_reference(plain, nn.CrossEntropyLoss(), x, target)
    model = extended_copy(plain)
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    run_second_order(model, lossfunc, x, target, ext.DiagGGNExact())
    for name, p in trainable(model).items():
        assert_close(p.diag_ggn_exact, torch.diagonal(blocks[name]).reshape(p.shape), name)
    run_second_order(model, lossfunc, x, target, ext.BatchDiagGGNExact())
    for name, p in trainable(model).items():
        assert_close(p.diag_ggn_exact_batch, per_sample[name], name)


def test_frozen_parameter_gets_nothing(seed):
    plain = _mlp().to(DT)
    plain[2].weight.requires_grad_(False)
    model = check_ggn(plain, _x(4), "ce", "mean")
    assert not hasattr(model[2].weight, "diag_ggn_exact")
    assert not hasattr(model[2].weight, "diag_ggn_exact_batch")


def test_model_partly_extended(seed):
    """Only a submodule is extended: it gets curvature, the rest gets nothing."""
    plain = _mlp().to(DT)
    x = _x(4)
    target = torch.randint(0, 3, (N,))
    blocks, _ = ggn_reference(plain, nn.CrossEntropyLoss(), x, target)
    model = plain
    curvopt.extend(model[2])
    run_second_order(model, curvopt.extend(nn.CrossEntropyLoss()), x, target, ext.DiagGGNExact())
    for name, p in model.named_parameters():
        if name.startswith("2."):
            assert_close(p.diag_ggn_exact, torch.diagonal(blocks[name]).reshape(p.shape), name)
        else:
            assert not hasattr(p, "diag_ggn_exact"), name


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("loss_name", list(LOSSES))
def test_linear_on_one_position(loss_name, reduction, seed):
    """``Linear`` on ``[N, 1, I]`` inputs takes the factorised diagonal of ``[N, I]`` inputs
    (one position), its columns ``[K, N, 1, O]`` read as ``[K, N, O]``."""
    check_ggn(nn.Sequential(nn.Linear(4, 3), nn.Flatten()), _x(1, 4), loss_name, reduction)
