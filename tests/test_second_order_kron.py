"""Kronecker factors (``KFLR``; ``KFAC``'s deterministic parts) against independent references.

* ``N = 1`` and one position: ``kron(*p.kflr)`` is the exact GGN block ``J^T H J``.
* Bias (one-dimensional) blocks are exact for any ``N``.
* Sequence ``Linear`` and ``Conv2d`` with ``kfac_approx="expand"`` / ``"reduce"`` follow the
  formulas of Eschenhagen et al. (2023), checked against the GGN w.r.t. the layer output
  (``G_z = J^T H J`` of the rest of the network) and ``F.unfold`` patches.
* ``Embedding`` factors ``[A (V x V), B (D x D)]`` equal those of the equivalent one-hot ``Linear``.
* Unsupported modules raise ``UnsupportedModuleError`` naming the module path; nothing is written.
"""

import copy
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    DT,
    assert_close,
    assert_no_attributes,
    extended_copy,
    ggn_reference,
    run_second_order,
    trainable,
)
from torch import nn
from torch.func import hessian, jacrev

import curvopt
from curvopt import extensions as ext
from curvopt.errors import UnsupportedModuleError

LOSSES = {
    "ce": lambda: nn.CrossEntropyLoss(),
    "mse": lambda: nn.MSELoss(reduction="sum"),
    "bce": lambda: nn.BCEWithLogitsLoss(),
}


def _target(loss_name, out):
    if loss_name == "ce":
        shape = list(out.shape)
        classes = shape.pop(1)
        return torch.randint(0, classes, shape)
    return torch.randn_like(out) if loss_name == "mse" else torch.rand_like(out)


def _run(plain, x, loss_name, *exts, target=None):
    """``(model, lossfunc, target)`` after one pass of an extended copy with ``exts``."""
    plain = plain.to(DT)
    with torch.no_grad():
        out = plain(x)
    target = _target(loss_name, out) if target is None else target
    lossfunc = LOSSES[loss_name]()
    model = extended_copy(plain)
    run_second_order(model, curvopt.extend(copy.deepcopy(lossfunc)), x, target, *exts)
    return model, lossfunc, target


def _check_shapes(p, factors):
    """``[B, A]`` with ``B`` ``out x out`` and ``A`` ``(in * prod(kernel))`` square, or ``[B]``."""
    if p.dim() == 1:
        assert len(factors) == 1 and factors[0].shape == (p.numel(), p.numel())
    else:
        out, rest = p.shape[0], p[0].numel()
        assert [f.shape for f in factors] == [(out, out), (rest, rest)]
    for f in factors:
        assert_close(f, f.T, "factor symmetry")
        assert torch.linalg.eigvalsh(f).min() > -1e-10 * max(f.abs().max().item(), 1e-30)


def layer_output_ggn(rest, z, lossfunc, target):
    """``G_z = J^T H J`` w.r.t. an intermediate ``z``, shaped ``[*z.shape, *z.shape]``."""
    rest = rest.to(DT)
    out = rest(z)
    jac = jacrev(rest)(z).reshape(out.numel(), z.numel())
    h = hessian(lambda o: lossfunc(o, target))(out.detach()).reshape(out.numel(), out.numel())
    return (jac.T @ h @ jac).reshape(*z.shape, *z.shape)


# ------------------------------------------------------------------------------ exactness


def _mlp():
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 5), nn.Sigmoid(), nn.Linear(5, 3))


def _single_location_cnn():
    """Conv with a single output location (3x3 kernel on a 3x3 input), then a Linear."""
    return nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Tanh(), nn.Linear(3, 4))


def _conv1d_single_location():
    return nn.Sequential(
        nn.Conv1d(3, 2, 4, dilation=2, padding=1), nn.Flatten(), nn.ReLU(), nn.Linear(2, 3)
    )


EXACT = {
    "mlp": (_mlp, (4,)),
    "conv2d": (_single_location_cnn, (2, 3, 3)),
    "conv1d-dilated": (_conv1d_single_location, (3, 5)),
    "linear-3d-T1": (lambda: nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)), (1, 4)),
}


@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize("loss_name", list(LOSSES))
@pytest.mark.parametrize("case", list(EXACT))
def test_kflr_single_sample_is_exact(case, loss_name, approx, seed):
    make, shape = EXACT[case]
    x = torch.randn(1, *shape, dtype=DT)
    model, lossfunc, target = _run(make(), x, loss_name, ext.KFLR(kfac_approx=approx))
    blocks, _ = ggn_reference(model, lossfunc, x, target)
    for name, p in trainable(model).items():
        _check_shapes(p, p.kflr)
        assert_close(torch.kron(*p.kflr) if p.dim() > 1 else p.kflr[0], blocks[name], name)


@pytest.mark.parametrize("loss_name", list(LOSSES))
def test_bias_and_norm_blocks_are_exact_for_any_batch(loss_name, seed):
    """One-dimensional parameters: ``[B]`` is the exact GGN block, also with positions."""
    plain = nn.Sequential(
        OrderedDict(
            conv=nn.Conv1d(2, 3, 3, padding=1),
            ln=nn.LayerNorm(5),
            act=nn.Tanh(),
            flat=nn.Flatten(),
            fc=nn.Linear(15, 4),
        )
    )
    with torch.no_grad():
        plain.ln.weight.uniform_(0.5, 1.5)
        plain.ln.bias.uniform_(-1, 1)
    x = torch.randn(3, 2, 5, dtype=DT)
    model, lossfunc, target = _run(plain, x, loss_name, ext.KFLR())
    blocks, _ = ggn_reference(model, lossfunc, x, target)
    for name, p in trainable(model).items():
        _check_shapes(p, p.kflr)
        if p.dim() == 1:
            assert_close(p.kflr[0], blocks[name], name)
    if loss_name == "ce":  # N > 1 and positions: the conv weight's factors only approximate
        assert not torch.allclose(torch.kron(*model.conv.weight.kflr), blocks["conv.weight"])


def test_kron_factor_order_is_vec_order(seed):
    """A non-square weight: ``kron(B, A)`` (not ``kron(A, B)``) is indexed like ``p.flatten()``."""
    plain = nn.Sequential(nn.Linear(2, 5, bias=False), nn.Tanh(), nn.Linear(5, 3, bias=False))
    x = torch.randn(1, 2, dtype=DT)
    model, lossfunc, target = _run(plain, x, "ce", ext.KFLR())
    blocks, _ = ggn_reference(model, lossfunc, x, target)
    b, a = model[0].weight.kflr
    assert b.shape == (5, 5) and a.shape == (2, 2)
    assert_close(torch.kron(b, a), blocks["0.weight"], "kron(B, A)")
    assert not torch.allclose(torch.kron(a, b), blocks["0.weight"])


# ------------------------------------------------------------------------------ formulas


def _linear_formula(x, g_z, approx):
    """``[B, A]`` for ``Linear`` input ``x [N, T, I]`` and output-GGN ``g_z [N,T,O,N,T,O]``."""
    n, t = x.shape[:2]
    per_sample = torch.stack([g_z[i, :, :, i] for i in range(n)])  # [N, T, O, T, O]
    if approx == "expand":
        b = sum(per_sample[:, s, :, s] for s in range(t)).sum(0)
        a = torch.einsum("nti,ntj->ij", x, x) / (n * t)
    else:
        b = per_sample.sum((1, 3)).sum(0)
        xbar = x.mean(1)
        a = xbar.T @ xbar / n
    return [b, a]


@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize("loss_name", list(LOSSES))
def test_sequence_linear_formula(approx, loss_name, seed):
    plain = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).to(DT)
    x = torch.randn(3, 5, 4, dtype=DT)
    model, lossfunc, target = _run(plain, x, loss_name, ext.KFLR(kfac_approx=approx))
    z = plain[0](x).detach()
    g_z = layer_output_ggn(plain[1:], z, lossfunc, target)
    expected = _linear_formula(x, g_z, approx)
    w = model[0].weight
    _check_shapes(w, w.kflr)
    assert_close(w.kflr[0], expected[0], "B")
    assert_close(w.kflr[1], expected[1], "A")
    # the two conventions differ on sequences (cross-position curvature: CE over positions)
    if loss_name != "ce":
        return
    other = "reduce" if approx == "expand" else "expand"
    assert not torch.allclose(_linear_formula(x, g_z, other)[0], expected[0])


def test_sequence_linear_4d_input(seed):
    """Extra leading dims ``[N, T1, T2, I]`` are positions too."""
    plain = nn.Sequential(nn.Linear(3, 2), nn.Tanh(), nn.Linear(2, 2)).to(DT)
    x = torch.randn(2, 2, 3, 3, dtype=DT)
    for approx in ("expand", "reduce"):
        model, lossfunc, target = _run(plain, x, "mse", ext.KFLR(kfac_approx=approx))
        z = plain[0](x).detach()
        g_z = layer_output_ggn(plain[1:], z, lossfunc, target).reshape(2, 6, 2, 2, 6, 2)
        expected = _linear_formula(x.reshape(2, 6, 3), g_z, approx)
        assert_close(model[0].weight.kflr[0], expected[0], f"{approx} B")
        assert_close(model[0].weight.kflr[1], expected[1], f"{approx} A")


@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_conv2d_formula(approx, seed):
    """KFC: positions are output locations, ``A`` from ``F.unfold`` patches."""
    conv = nn.Conv2d(2, 3, (2, 3), stride=(1, 2), padding=1, dilation=(2, 1))
    plain = nn.Sequential(conv, nn.Tanh(), nn.Flatten(), nn.LazyLinear(3))
    x = torch.randn(3, 2, 4, 5, dtype=DT)
    plain(x.float())  # materialise the lazy layer
    model, lossfunc, target = _run(plain, x, "ce", ext.KFLR(kfac_approx=approx))
    conv = plain[0]
    z = conv(x).detach()  # [N, C, H, W]
    n, c = z.shape[:2]
    g_z = layer_output_ggn(plain[1:], z, lossfunc, target).reshape(n, c, -1, n, c, z[0, 0].numel())
    g_z = g_z.permute(0, 2, 1, 3, 5, 4)  # [N, L, C, N, L, C]
    patches = F.unfold(x, conv.kernel_size, conv.dilation, conv.padding, conv.stride).transpose(
        1, 2
    )
    expected = _linear_formula(patches, g_z, approx)
    w = model[0].weight
    _check_shapes(w, w.kflr)
    assert_close(w.kflr[0], expected[0], "B")
    assert_close(w.kflr[1], expected[1], "A")


# ------------------------------------------------------------------------------ Embedding


class _Emb(nn.Module):
    def __init__(self, padding_idx=None):
        super().__init__()
        self.emb = nn.Embedding(6, 3, padding_idx=padding_idx)
        self.head = nn.Sequential(nn.Tanh(), nn.Linear(3, 4))

    def forward(self, idx):
        return self.head(self.emb(idx)).transpose(1, 2)


class _OneHot(nn.Module):
    """The same function as ``_Emb`` with the lookup written as a bias-free ``Linear`` on one-hot
    tokens (padding tokens map to a zero vector): ``lin.weight == emb.weight.T``."""

    def __init__(self, emb_model):
        super().__init__()
        emb = emb_model.emb
        self.vocab, self.padding_idx = emb.num_embeddings, emb.padding_idx
        self.lin = nn.Linear(self.vocab, emb.embedding_dim, bias=False)
        with torch.no_grad():
            self.lin.weight.copy_(emb.weight.T)
        self.head = copy.deepcopy(emb_model.head)

    def forward(self, idx):
        onehot = F.one_hot(idx, self.vocab).to(self.lin.weight.dtype)
        if self.padding_idx is not None:
            onehot[..., self.padding_idx] = 0
        return self.head(self.lin(onehot)).transpose(1, 2)


@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize("padding_idx", [None, 0])
def test_embedding_factors_match_one_hot_linear(approx, padding_idx, seed):
    plain = _Emb(padding_idx).to(DT)
    idx = torch.tensor([[0, 1, 1, 3], [2, 0, 5, 5]])
    target = torch.randint(0, 4, (2, 4))
    model, _, _ = _run(plain, idx, "ce", ext.KFLR(kfac_approx=approx), target=target)
    twin, _, _ = _run(_OneHot(plain), idx, "ce", ext.KFLR(kfac_approx=approx), target=target)
    a, b = model.emb.weight.kflr
    assert a.shape == (6, 6) and b.shape == (3, 3)
    assert_close(b, twin.lin.weight.kflr[0], "B (embedding dim)")
    assert_close(a, twin.lin.weight.kflr[1], "A (vocabulary)")
    if padding_idx is not None:
        assert a[padding_idx].abs().max() == 0


def test_embedding_single_token_is_exact(seed):
    plain = _Emb().to(DT)
    idx = torch.tensor([[4]])
    model, lossfunc, target = _run(plain, idx, "ce", ext.KFLR())
    blocks, _ = ggn_reference(model, lossfunc, idx, target)
    a, b = model.emb.weight.kflr
    assert_close(torch.kron(a, b), blocks["emb.weight"], "kron(A, B)")


# ------------------------------------------------------------------------------ scaling


def test_mean_and_sum_reductions_differ_by_n(seed):
    plain = _mlp().to(DT)
    x = torch.randn(4, 4, dtype=DT)
    target = torch.randn(4, 3, dtype=DT)
    results = {}
    for reduction in ("mean", "sum"):
        model = extended_copy(plain)
        run_second_order(
            model, curvopt.extend(nn.MSELoss(reduction=reduction)), x, target, ext.KFLR()
        )
        results[reduction] = [
            torch.kron(*p.kflr) if p.dim() > 1 else p.kflr[0] for p in model.parameters()
        ]
    for mean, total in zip(results["mean"], results["sum"]):
        assert_close(mean * x.shape[0] * 3, total, "sum = N * D * mean for MSE")


# ------------------------------------------------------------------------------ errors


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(OrderedDict(shared=nn.Linear(3, 3)))
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        h = self.block.shared(torch.tanh(self.block.shared(x)))
        return self.head(h)


class _Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(4, 3, batch_first=True)

    def forward(self, x):
        return self.rnn(x)[0]


ERRORS = {
    "conv-transpose": (
        lambda: nn.Sequential(OrderedDict(up=nn.ConvTranspose1d(2, 3, 3))),
        (2, 4),
        "up",
        "ConvTranspose1d",
    ),
    "recurrent": (
        lambda: nn.Sequential(OrderedDict(enc=_Recurrent())),
        (3, 4),
        "enc.rnn",
        "GRU",
    ),
}


@pytest.mark.parametrize("extension", ["kflr", "kfac"])
@pytest.mark.parametrize("case", list(ERRORS))
def test_unsupported_modules_raise(case, extension, seed):
    make, shape, path, words = ERRORS[case]
    model = extended_copy(make().to(DT))
    x = torch.randn(2, *shape, dtype=DT)
    loss = curvopt.extend(nn.MSELoss())(model(x), torch.zeros_like(model(x)))
    kron = ext.KFLR() if extension == "kflr" else ext.KFAC()
    with (
        pytest.raises(UnsupportedModuleError) as info,
        curvopt.collect(ext.DiagGGNExact(), kron, ext.BatchGrad()),
    ):
        loss.backward()
    message = str(info.value)
    assert path in message and words in message, message
    assert_no_attributes(model)
