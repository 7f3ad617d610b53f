"""Kronecker factors of grouped convolutions (``groups = G > 1``, depthwise included).

The contract (``/work/shared/API.md``, "Grouped convolutions"): factors stacked per group,
``B [G, out/G, out/G]``, ``A [G, in/G·∏k, in/G·∏k]``, a bias's ``[B]`` with ``B [G, out/G,
out/G]``; ``kron(B[g], A[g])`` is group ``g``'s block (output channels ``g out/G : (g+1) out/G``,
the rows ``g out/G ∏.. : ..`` of ``vec(p)``). References, all float64 and independent of the
grouped code: the same convolution written as ``G`` separate ``nn.Conv`` on their channel slices
(each an ordinary ``groups=1`` layer), the dense GGN from ``torch.func`` (``ggn_reference``), and
the damped inverses written out per group by hand.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

import curvopt
from curvopt import extensions as ext
from curvopt import linalg
from curvopt.errors import UnsupportedModuleError

from conftest import DT, ggn_reference

#: name -> (conv dims, in, out, groups, conv keyword arguments, input spatial size)
CASES = {
    "depthwise2d": (2, 4, 4, 4, dict(kernel_size=3, padding=1), 5),
    "grouped2d-wider-out-strided": (2, 4, 6, 2, dict(kernel_size=3, stride=2, padding=1), 6),
    "depthwise-multiplier2d-reflect": (
        2, 3, 6, 3, dict(kernel_size=2, padding=1, padding_mode="reflect"), 4,
    ),
    "grouped1d-dilated-no-bias": (
        1, 6, 3, 3, dict(kernel_size=2, padding=2, dilation=2, bias=False), 7,
    ),
    "grouped3d": (3, 4, 2, 2, dict(kernel_size=2), 3),
}  # fmt: skip

_CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}


class PerGroup(nn.Module):
    """A grouped convolution as ``G`` ordinary ones, each on its slice of the channels."""

    def __init__(self, conv: nn.Module):
        super().__init__()
        groups, cls = conv.groups, type(conv)
        self.groups = groups
        c_in, c_out = conv.in_channels // groups, conv.out_channels // groups
        options = dict(
            kernel_size=conv.kernel_size,
            stride=conv.stride,
            padding=conv.padding,
            dilation=conv.dilation,
            bias=conv.bias is not None,
            padding_mode=conv.padding_mode,
        )
        self.convs = nn.ModuleList(cls(c_in, c_out, **options).to(DT) for _ in range(groups))
        with torch.no_grad():
            for g, part in enumerate(self.convs):
                part.weight.copy_(conv.weight[g * c_out : (g + 1) * c_out])
                if conv.bias is not None:
                    part.bias.copy_(conv.bias[g * c_out : (g + 1) * c_out])

    def forward(self, x):
        slices = x.chunk(self.groups, dim=1)
        return torch.cat([conv(part) for conv, part in zip(self.convs, slices)], dim=1)


def _problem(case: str, n: int = 5, seed: int = 0):
    """``(grouped model, its per-group twin, X, y)``: conv, tanh, flatten, linear head."""
    dims, c_in, c_out, groups, options, size = CASES[case]
    torch.manual_seed(seed)
    conv = _CONV[dims](c_in, c_out, groups=groups, **options).to(DT)
    x = torch.randn(n, c_in, *[size] * dims, dtype=DT)
    features = conv(x)[0].numel()
    head = nn.Linear(features, 3).to(DT)
    model = nn.Sequential(conv, nn.Tanh(), nn.Flatten(), head)
    twin = nn.Sequential(PerGroup(conv), nn.Tanh(), nn.Flatten(), copy.deepcopy(head))
    y = torch.randint(0, 3, (n,))
    return curvopt.extend(model), curvopt.extend(twin), x, y


def _collect(model, x, y, extension, reduction="mean", seed=7):
    lossfunc = curvopt.extend(nn.CrossEntropyLoss(reduction=reduction))
    torch.manual_seed(seed)
    with curvopt.collect(extension):
        lossfunc(model(x), y).backward()


def _group_params(model, twin):
    """``(grouped parameter, [the twin's parameter of each group])`` for weight and bias."""
    conv, parts = model[0], twin[0].convs
    pairs = [(conv.weight, [part.weight for part in parts])]
    if conv.bias is not None:
        pairs.append((conv.bias, [part.bias for part in parts]))
    return pairs


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize("extension", ["kflr", "kfac"])
@pytest.mark.parametrize("case", list(CASES))
def test_factors_are_those_of_the_per_group_twin(case, extension, approx, reduction):
    model, twin, x, y = _problem(case)
    make = {"kflr": ext.KFLR, "kfac": ext.KFAC}[extension]
    for net in (model, twin):  # the same seed: the same sampled targets for KFAC
        _collect(net, x, y, make(kfac_approx=approx), reduction)
    groups = model[0].groups
    for p, parts in _group_params(model, twin):
        factors = getattr(p, extension)
        expected = len(getattr(parts[0], extension))
        assert len(factors) == expected
        for index, factor in enumerate(factors):
            side = [getattr(part, extension)[index] for part in parts]
            assert factor.shape == (groups, *side[0].shape)
            torch.testing.assert_close(factor, torch.stack(side), rtol=1e-10, atol=1e-12)
    for mine, theirs in zip(model[3].parameters(), twin[3].parameters()):  # the head: unchanged
        for f, g in zip(getattr(mine, extension), getattr(theirs, extension)):
            torch.testing.assert_close(f, g, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", ["depthwise2d", "grouped2d-wider-out-strided", "grouped3d"])
def test_ekfac_is_that_of_the_per_group_twin(case):
    model, twin, x, y = _problem(case)
    for net in (model, twin):
        _collect(net, x, y, ext.EKFAC(factors="kflr"))
    for p, parts in _group_params(model, twin):
        s, *bases = p.ekfac
        for g, part in enumerate(parts):
            s_g, *bases_g = part.ekfac
            assert s.shape == (len(parts), *s_g.shape)  # [G, out/G, in/G·k] ([G, out/G, 1])
            assert [q.shape for q in bases] == [(len(parts), *q.shape) for q in bases_g]
            # the matrix Q diag(vec S) Qᵀ of each group: free of the eigenvectors' signs
            mine = _eigen_matrix(s[g], [q[g] for q in bases])
            theirs = _eigen_matrix(s_g, bases_g)
            torch.testing.assert_close(mine, theirs, rtol=1e-9, atol=1e-12)


def _eigen_matrix(s, bases):
    q = bases[0] if len(bases) == 1 else torch.kron(*bases)
    return q @ torch.diag(s.flatten()) @ q.T


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("groups, c_in, c_out", [(2, 4, 6), (3, 3, 3)])
def test_one_sample_at_one_location_gives_each_groups_exact_ggn_block(
    groups, c_in, c_out, reduction
):
    torch.manual_seed(1)
    conv = nn.Conv2d(c_in, c_out, 3, groups=groups).to(DT)  # 3x3 input: one output location
    model = nn.Sequential(conv, nn.Tanh(), nn.Flatten(), nn.Linear(c_out, 3).to(DT))
    x, y = torch.randn(1, c_in, 3, 3, dtype=DT), torch.tensor([2])
    lossfunc = nn.CrossEntropyLoss(reduction=reduction)
    blocks, _ = ggn_reference(model, lossfunc, x, y)
    model = curvopt.extend(model)
    _collect(model, x, y, ext.KFLR(), reduction)
    rows = c_out // groups
    for name, p in (("0.weight", conv.weight), ("0.bias", conv.bias)):
        width = p[0].numel() * rows  # the entries of vec(p) in one group
        for g in range(groups):
            factors = [f[g] for f in p.kflr]
            block = factors[0] if len(factors) == 1 else torch.kron(*factors)
            exact = blocks[name][g * width : (g + 1) * width, g * width : (g + 1) * width]
            torch.testing.assert_close(block, exact, rtol=1e-10, atol=1e-12)


def _dense_blocks(factors):
    """The dense block-diagonal ``⊕_g kron(B_g, A_g)`` (``⊕_g B_g``) of stacked factors, or
    ``kron(B, A)`` of ordinary ones."""
    if factors[0].dim() == 2:
        return factors[0] if len(factors) == 1 else torch.kron(*factors)
    return torch.block_diag(
        *[_dense_blocks([f[g] for f in factors]) for g in range(len(factors[0]))]
    )


def _trace_norm_inverse(factors, damping):
    """The trace-norm damped inverse written out densely, group by group."""
    if factors[0].dim() == 3:
        blocks = [
            _trace_norm_inverse([f[g] for f in factors], damping) for g in range(len(factors[0]))
        ]
        return torch.block_diag(*blocks)
    if len(factors) == 1:
        return torch.linalg.inv(factors[0] + damping * torch.eye(len(factors[0]), dtype=DT))
    b, a = factors
    pi = ((a.trace() / len(a)) / (b.trace() / len(b))).sqrt()
    root = damping**0.5
    damped_b = b + root / pi * torch.eye(len(b), dtype=DT)
    damped_a = a + pi * root * torch.eye(len(a), dtype=DT)
    return torch.kron(torch.linalg.inv(damped_b), torch.linalg.inv(damped_a))


@pytest.mark.parametrize("case", list(CASES))
def test_linalg_kfac_applies_the_per_group_blocks_and_their_inverses(case):
    model, _, x, y = _problem(case)
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    K = linalg.KFAC(model, lossfunc, [(x, y)], curvature="kflr")
    dense = torch.block_diag(*[_dense_blocks(fs) for fs in K.factors]).numpy()
    assert K.factors[0][0].dim() == 3
    np.testing.assert_allclose(K.to_dense(), dense, rtol=1e-10, atol=1e-13)
    v = np.random.default_rng(0).standard_normal(K.shape[0])
    damping = 0.1
    inverse = torch.block_diag(*[_trace_norm_inverse(fs, damping) for fs in K.factors]).numpy()
    np.testing.assert_allclose(K.inverse(damping) @ v, inverse @ v, rtol=1e-9, atol=1e-11)
    exact = K.inverse(damping, kronecker_damping="exact")
    np.testing.assert_allclose(exact @ (dense @ v + damping * v), v, rtol=1e-9, atol=1e-10)
    # the twin's operator, its entries reordered to the grouped layout: the same matrix
    _, twin, _, _ = _problem(case)
    twin_dense = linalg.KFAC(twin, lossfunc, [(x, y)], curvature="kflr").to_dense()
    order = _twin_order(model, twin)
    np.testing.assert_allclose(K.to_dense(), twin_dense[np.ix_(order, order)], atol=1e-12)


def _twin_order(model, twin):
    """For each entry of the grouped model's parameter vector, its index in the twin's."""
    offsets, start = {}, 0
    for p in twin.parameters():
        offsets[id(p)] = start
        start += p.numel()
    order = []
    for _, parts in _group_params(model, twin):
        order += [offsets[id(part)] + i for part in parts for i in range(part.numel())]
    for theirs in twin[3].parameters():  # the head, as it is
        order += [offsets[id(theirs)] + i for i in range(theirs.numel())]
    return np.array(order)


def _depthwise_model(seed):
    torch.manual_seed(seed)
    return curvopt.extend(
        nn.Sequential(
            nn.Conv2d(3, 6, 3, padding=1, groups=3), nn.Tanh(),
            nn.Conv2d(6, 6, 3, padding=1, groups=6), nn.Tanh(),
            nn.Flatten(), nn.Linear(6 * 16, 3),
        ).to(DT)
    )  # fmt: skip


def _batch(seed, n=8):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 4, 4, dtype=DT, generator=gen)
    return x, torch.randint(0, 3, (n,), generator=gen)


@pytest.mark.parametrize("kronecker_damping", ["trace_norm", "trace_norm_eigh", "exact"])
def test_kfac_step_is_the_per_group_damped_newton_step(kronecker_damping):
    model, (x, y) = _depthwise_model(0), _batch(0)
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    lr, damping = 0.3, 1e-2
    _collect(model, x, y, ext.KFLR())
    expected = []
    for p in model.parameters():
        grad = p.grad.flatten()
        if kronecker_damping == "exact":
            dense = _dense_blocks(p.kflr)
            inverse = torch.linalg.inv(dense + damping * torch.eye(len(dense), dtype=DT))
        else:
            inverse = _trace_norm_inverse(p.kflr, damping)
        expected.append(p.detach() - lr * (inverse @ grad).reshape(p.shape))
        p.grad = None
    opt = curvopt.optim.KFAC(
        model.parameters(), lr=lr, damping=damping, curvature="kflr", kl_clip=None,
        kronecker_damping=kronecker_damping,
    )  # fmt: skip
    opt.zero_grad()
    lossfunc(model(x), y).backward()
    opt.step()
    for p, want in zip(model.parameters(), expected):
        torch.testing.assert_close(p.detach(), want, rtol=0, atol=1e-12)


def test_ekfac_step_is_the_per_group_eigen_corrected_step():
    model, (x, y) = _depthwise_model(1), _batch(1)
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    lr, damping = 0.3, 1e-2
    _collect(model, x, y, ext.EKFAC(factors="kflr"))
    expected = []
    for p in model.parameters():
        s, *bases = p.ekfac
        if bases[0].dim() == 3:
            q = torch.block_diag(*[_dense_blocks([b[g] for b in bases]) for g in range(len(s))])
        else:
            q = _dense_blocks(bases)
        direction = q @ ((q.T @ p.grad.flatten()) / (s.flatten() + damping))
        expected.append(p.detach() - lr * direction.reshape(p.shape))
        p.grad = None
    opt = curvopt.optim.EKFAC(  # the paper's update: the basis of this step's own factors
        model.parameters(),
        lr=lr,
        damping=damping,
        curvature="kflr",
        kl_clip=None,
        basis_source="current",
    )
    opt.zero_grad()
    lossfunc(model(x), y).backward()
    opt.step()
    for p, want in zip(model.parameters(), expected):
        torch.testing.assert_close(p.detach(), want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("optimizer", ["KFAC", "EKFAC"])
def test_a_depthwise_model_trains(optimizer, seed):
    model, (x, y) = _depthwise_model(seed), _batch(seed, n=16)
    lossfunc = nn.CrossEntropyLoss()
    opt = getattr(curvopt.optim, optimizer)(model.parameters(), lr=0.2, damping=1e-2)
    first = lossfunc(model(x), y).item()
    for _ in range(15):
        opt.zero_grad()
        loss = lossfunc(model(x), y)
        loss.backward()
        opt.step()
    assert lossfunc(model(x), y).item() < 0.5 * first


def test_a_reused_grouped_conv_gets_each_groups_nearest_kronecker_product():
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 4, 3, padding=1, groups=2).to(DT)
    model = curvopt.extend(
        nn.Sequential(conv, nn.Tanh(), conv, nn.Flatten(), nn.Linear(64, 3).to(DT))
    )
    twin_conv = PerGroup(conv)
    twin = curvopt.extend(
        nn.Sequential(twin_conv, nn.Tanh(), twin_conv, nn.Flatten(), copy.deepcopy(model[4]))
    )
    x, y = torch.randn(3, 4, 4, 4, dtype=DT), torch.tensor([0, 1, 2])
    for net in (model, twin):
        _collect(net, x, y, ext.KFLR())
    for index, factor in enumerate(conv.weight.kflr):
        side = torch.stack([part.weight.kflr[index] for part in twin_conv.convs])
        torch.testing.assert_close(factor, side, rtol=1e-9, atol=1e-12)


def test_kfra_on_a_grouped_conv_raises_naming_the_module():
    model, _, x, y = _problem("depthwise2d")
    with pytest.raises(UnsupportedModuleError, match=r"'0' \(Conv2d\)"):
        _collect(model, x, y, ext.KFRA())
    assert not hasattr(model[0].weight, "kfra")


def test_laplace_kron_on_a_grouped_conv_raises_naming_the_module():
    pytest.importorskip("laplace")
    from laplace import Laplace

    from curvopt.laplace import CurvoptGGN

    model, _, x, y = _problem("grouped2d-wider-out-strided")
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=5)
    la = Laplace(
        model, "classification", subset_of_weights="all", hessian_structure="kron",
        backend=CurvoptGGN,
    )  # fmt: skip
    with pytest.raises(UnsupportedModuleError, match=r"'0' \(Conv2d\).*hessian_structure='diag'"):
        la.fit(loader)
    assert not hasattr(model[0].weight, "kflr")


def _twin_of(model):
    """A copy of ``model`` with each grouped convolution written per group (:class:`PerGroup`)."""
    layers = [PerGroup(m) if getattr(m, "groups", 1) > 1 else copy.deepcopy(m) for m in model]
    return curvopt.extend(nn.Sequential(*layers))


def _grouped_view(twin):
    """The twin's parameters in the grouped model's layout (each group's slices concatenated)."""
    flat = []
    for layer in twin:
        if isinstance(layer, PerGroup):
            flat.append(torch.cat([part.weight for part in layer.convs]))
            flat.append(torch.cat([part.bias for part in layer.convs]))
        else:
            flat.extend(layer.parameters())
    return flat


OPTIMIZERS = {
    "kfac": ("KFAC", {}),
    "kfac-mc-exact": ("KFAC", dict(curvature="kfac", kronecker_damping="exact")),
    "kfac-eigh-reused": ("KFAC", dict(kronecker_damping="trace_norm_eigh", inverse_interval=2)),
    "kfac-ema-momentum": ("KFAC", dict(curvature_ema=0.9, momentum=0.9, curvature_interval=2)),
    "ekfac": ("EKFAC", dict(curvature="kflr")),
    "ekfac-one-sided": ("EKFAC", dict(curvature="kflr", max_basis_dim=8)),
    "eigen-adam": ("EigenAdam", {}),
    "eigen-adam-one-sided": ("EigenAdam", dict(max_basis_dim=8)),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizers_step_a_grouped_model_as_its_per_group_twin(name):
    """Every step of a grouped model equals that of its per-group twin: the per-group blocks,
    their damping (π per group), inverses, eigenbases (one-sided with ``max_basis_dim=8``: the
    convolutions' 9-wide input sides keep the identity, their output sides and biases are
    rotated, in both) and trust region."""
    kind, options = OPTIMIZERS[name]
    model, (x, y) = _depthwise_model(3), _batch(3)
    twin = _twin_of(model)
    lossfunc = nn.CrossEntropyLoss()
    settings = dict(lr=0.01) if kind == "EigenAdam" else dict(lr=0.2, damping=1e-2)
    settings |= options
    optimizers = [
        getattr(curvopt.optim, kind)(net.parameters(), **settings) for net in (model, twin)
    ]
    for step in range(4):
        for net, opt in zip((model, twin), optimizers):
            torch.manual_seed(step)  # the same sampled targets in both
            opt.zero_grad()
            lossfunc(net(x), y).backward()
            opt.step()
    assert lossfunc(model(x), y).item() < lossfunc(_depthwise_model(3)(x), y).item()
    for mine, theirs in zip(model.parameters(), _grouped_view(twin)):  # (Adam: rounding / √v)
        torch.testing.assert_close(mine, theirs, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("case", ["depthwise2d", "grouped2d-wider-out-strided"])
def test_linalg_ekfac_is_that_of_the_per_group_twin(case):
    model, twin, x, y = _problem(case)
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    data = [(x[:3], y[:3]), (x[3:], y[3:])]
    mine = linalg.EKFAC(model, lossfunc, data, curvature="kflr")
    theirs = linalg.EKFAC(twin, lossfunc, data, curvature="kflr")
    assert mine.bases[0][0].dim() == 3 and mine.corrections[0].dim() == 3
    order = _twin_order(model, twin)
    expected = theirs.to_dense()[np.ix_(order, order)]
    np.testing.assert_allclose(mine.to_dense(), expected, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("kind", ["trace_norm", "trace_norm_eigh", "exact"])
@pytest.mark.parametrize("reused", [False, True])
def test_kronecker_inverse_buffers_match_what_is_computed(kind, reused):
    """Under ``torch.distributed`` a rank receives an inverse into ``KroneckerInverse.empty``'s
    tensors: of the computed structure and shapes for stacked factors too."""
    from curvopt.inversion.kronecker import InverseOptions, KroneckerInverse

    gen = torch.Generator().manual_seed(0)
    roots = [
        torch.randn(3, 7, 2, generator=gen, dtype=DT),
        torch.randn(3, 7, 5, generator=gen, dtype=DT),
    ]
    factors = [r.mT @ r for r in roots]
    options = InverseOptions(kind, reused=reused, low_rank=False)
    computed = KroneckerInverse.compute(factors, 1e-2, options)
    empty = KroneckerInverse.empty(factors, options)
    shapes = lambda value: [tuple(t.shape) for t in torch.utils._pytree.tree_leaves(value)]
    assert shapes(empty) == shapes(computed)


@pytest.mark.parametrize("case", ["depthwise2d", "grouped1d-dilated-no-bias"])
def test_input_factor_in_chunks_of_samples_is_the_whole_batchs(case, monkeypatch):
    from curvopt.layers import kron

    model, _, x, y = _problem(case)
    _collect(model, x, y, ext.KFLR())
    whole = [f.clone() for f in model[0].weight.kflr]
    chunks = []
    monkeypatch.setattr(kron, "_INPUT_BUDGET", 1)  # one sample per chunk
    monkeypatch.setattr(
        kron, "_scaled_gram", lambda *a, f=kron._scaled_gram: chunks.append(1) or f(*a)
    )
    _collect(model, x, y, ext.KFLR())
    assert len(chunks) == len(x)
    for chunked, expected in zip(model[0].weight.kflr, whole):
        torch.testing.assert_close(chunked, expected, rtol=1e-12, atol=1e-14)


def test_psd_eigh_of_stacked_factors_is_each_ones():
    """Batched where it can be, matrix by matrix where a zero row needs deflation."""
    from curvopt.core.psd import psd_eigh

    gen = torch.Generator().manual_seed(0)
    roots = torch.randn(4, 6, 5, generator=gen, dtype=DT)
    roots[1, :, 2] = 0  # a zero row and column (an input always 0)
    matrices = roots.mT @ roots
    values, vectors = psd_eigh(matrices)
    for g in range(4):
        s, q = psd_eigh(matrices[g])
        torch.testing.assert_close(values[g], s, rtol=0, atol=1e-12)
        rebuilt = vectors[g] @ torch.diag(values[g]) @ vectors[g].T
        torch.testing.assert_close(rebuilt, matrices[g], rtol=0, atol=1e-12)
    assert values[1, 0] == 0 and vectors[1][2].abs().max() == 1  # the deflated unit vector
    matrices[2, 0, 0] = float("nan")
    with pytest.raises(torch.linalg.LinAlgError, match="non-finite"):
        psd_eigh(matrices)


def test_kfac_through_batchnorm_in_training_mode_is_that_of_the_per_group_twin():
    """A pass whose columns cross a module mixing samples (``coupled``): the bias's block from
    the batch gradients of the columns, cut to each group's diagonal block."""
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 6, 3, padding=1, groups=2).to(DT)
    norm, head = nn.BatchNorm2d(6).to(DT), nn.Linear(6 * 16, 3).to(DT)
    model = curvopt.extend(nn.Sequential(conv, norm, nn.Tanh(), nn.Flatten(), head))
    twin = curvopt.extend(
        nn.Sequential(
            PerGroup(conv), copy.deepcopy(norm), nn.Tanh(), nn.Flatten(), copy.deepcopy(head)
        )
    )
    x, y = torch.randn(6, 4, 4, 4, dtype=DT), torch.tensor([0, 1, 2, 0, 1, 2])
    for net in (model, twin):
        _collect(net, x, y, ext.KFAC(mc_samples=2))
    for p, parts in _group_params(model, twin):
        for index, factor in enumerate(p.kfac):
            side = torch.stack([part.kfac[index] for part in parts])
            torch.testing.assert_close(factor, side, rtol=1e-10, atol=1e-12)
