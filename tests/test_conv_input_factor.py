"""A convolution's input-side Kronecker factor from the input's correlations and border strips
(``layers.conv_input_factor``) against the unfolded patches' Gram, written here: ``F.unfold``
(2-D) or the padded input sliced at every kernel offset (1-D, 2-D, 3-D), times its transpose.
End to end, ``KFLR`` and ``KFAC`` with the correlations forced on (the shape rule's thresholds
lowered) equal those of the unfolded route, and the shape rule keeps the unfolded route where
the correlations do not apply or do not pay."""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import curvopt
import curvopt.layers.conv_input_factor as conv_input_factor
from curvopt import extensions as ext
from curvopt.layers.conv_input_factor import correlation_input_factor, correlation_pays

DT = torch.float64
CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}


def _sliced_gram(conv, x):
    """``1/(N L) Σ_{n,l} u u^T`` with ``u`` the patch at location ``l``, channel-major, from
    the zero-padded input sliced at every kernel offset."""
    pad = conv._reversed_padding_repeated_twice
    padded = F.pad(x, list(pad))
    n, c, *size = padded.shape
    out = [s - k + 1 for s, k in zip(size, conv.kernel_size)]
    slices = []
    for offset in itertools.product(*(range(k) for k in conv.kernel_size)):
        window = (slice(None), slice(None), *(slice(o, o + size) for o, size in zip(offset, out)))
        slices.append(padded[window].reshape(n, c, -1))
    patches = torch.stack(slices, 2).reshape(n, -1, math.prod(out))  # [N, C k, L]
    rows = patches.transpose(1, 2).reshape(-1, patches.shape[1])
    return rows.T @ rows / rows.shape[0]


def _unfold_gram(conv, x):
    """The same for 2-D by ``F.unfold`` (integer padding only)."""
    patches = F.unfold(x, conv.kernel_size, padding=conv.padding)  # [N, C k, L]
    rows = patches.transpose(1, 2).reshape(-1, patches.shape[1])
    return rows.T @ rows / rows.shape[0]


def _shapes():
    """(dims, kernel, size, padding, channels, batch): odd, even and rectangular kernels,
    non-square inputs, kernels wider than the input, batch 1 and one channel."""
    cases = [
        (1, (3,), (7,), 1, 2, 3),
        (1, (4,), (9,), "same", 3, 2),
        (1, (5,), (3,), 2, 1, 1),
        (1, (2,), (6,), 0, 2, 2),
        (1, (5,), (11,), 4, 2, 1),
        (2, (3, 3), (16, 16), 1, 4, 3),
        (2, (3, 3), (5, 7), 0, 2, 2),
        (2, (5, 5), (6, 9), 2, 1, 1),
        (2, (2, 3), (4, 5), 1, 3, 2),
        (2, (4, 2), (7, 3), "same", 2, 2),
        (2, (3, 5), (3, 8), "valid", 2, 3),
        (2, (5, 3), (3, 4), (3, 1), 2, 2),
        (2, (1, 3), (4, 6), (0, 1), 3, 2),
        (2, (3, 3), (2, 2), 2, 2, 1),
        (3, (3, 3, 3), (4, 5, 3), 1, 2, 2),
        (3, (2, 3, 2), (3, 4, 5), "same", 2, 1),
        (3, (3, 1, 2), (5, 3, 4), 0, 1, 2),
    ]
    generator = torch.Generator().manual_seed(0)
    for trial in range(30):  # random shapes
        dims = 1 + trial % 3
        draw = lambda high: int(torch.randint(1, high, (), generator=generator))  # noqa: E731
        kernel = tuple(draw(5 if dims < 3 else 4) for _ in range(dims))
        size = tuple(max(k - 2, 1) + draw(6) for k in kernel)
        padding = [0, 1, 2, 3, "same"][trial % 5]
        cases.append((dims, kernel, size, padding, draw(4), draw(4)))
    return cases


def _valid(conv, size):
    """Whether the convolution has an output for this input size."""
    pad = conv._reversed_padding_repeated_twice
    padded = [s + pad[2 * t] + pad[2 * t + 1] for t, s in enumerate(reversed(size))]
    return all(p >= k for p, k in zip(reversed(padded), conv.kernel_size))


@pytest.mark.parametrize("case", _shapes(), ids=str)
def test_factor_is_the_unfolded_gram(case):
    dims, kernel, size, padding, channels, batch = case
    conv = CONV[dims](channels, 2, kernel, padding=padding).to(DT)
    if not _valid(conv, size):
        pytest.skip("no output for this input size")
    torch.manual_seed(1)
    x = torch.randn(batch, channels, *size, dtype=DT)
    factor = correlation_input_factor(conv, x)
    expected = _sliced_gram(conv, x)
    torch.testing.assert_close(factor, expected, rtol=1e-12, atol=1e-12)
    if dims == 2 and not isinstance(padding, str):
        torch.testing.assert_close(factor, _unfold_gram(conv, x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layout", ["channels_last", "transposed"])
def test_strided_inputs(layout):
    """Inputs not contiguous in the default layout give the same factor."""
    conv = nn.Conv2d(3, 2, 3, padding=1).to(DT)
    torch.manual_seed(0)
    x = torch.randn(5, 3, 6, 7, dtype=DT)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    else:
        x = x.transpose(2, 3).contiguous().transpose(2, 3)
    assert not x.is_contiguous()
    factor = correlation_input_factor(conv, x)
    torch.testing.assert_close(factor, _unfold_gram(conv, x), rtol=1e-12, atol=1e-12)


def test_index_maps_are_built_once_per_shape():
    """A second input of the same shape reuses the first one's index maps (``_terms``)."""
    conv = nn.Conv2d(3, 2, 3, padding=1).to(DT)
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 6, dtype=DT)
    first = correlation_input_factor(conv, x)
    before = conv_input_factor._terms.cache_info()
    second = correlation_input_factor(conv, 2 * x)
    after = conv_input_factor._terms.cache_info()
    assert (after.hits, after.misses) == (before.hits + 1, before.misses)
    torch.testing.assert_close(second, 4 * first, rtol=1e-12, atol=0)
    torch.testing.assert_close(second, _unfold_gram(conv, 2 * x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_float32_factor_is_close(seed):
    """In float32 (the correlations summed in chunks of samples, minus the border terms) the
    factor is within eight float32 epsilons of its largest entry from the float64 Gram (2.7-4.5
    in eight seeds, at one and two threads; the unfolded patches' Gram 1.3-2.5; about 20
    when the weight gradient sums all 8192 products of an entry one after the other). The
    bound is absolute: the Gram's own error moves with the BLAS and its thread count."""
    torch.manual_seed(seed)
    conv = nn.Conv2d(16, 4, 3, padding=1)
    x = torch.randn(32, 16, 16, 16) + 0.5  # (an offset, as after a ReLU)
    expected = _unfold_gram(conv.to(DT), x.to(DT))
    error = (correlation_input_factor(conv.float(), x).to(DT) - expected).abs().max()
    assert error <= 8 * torch.finfo(torch.float32).eps * expected.abs().max()


def _factors(make, shape, extension, monkeypatch, forced: bool):
    """The weights' Kronecker factors of a small conv net after one pass, with the
    correlations forced on (``forced``) or off; and how many factors they gave."""
    calls = []
    if forced:
        monkeypatch.setattr(conv_input_factor, "_MIN_CHANNELS", 1)
        monkeypatch.setattr(conv_input_factor, "_MIN_GRAM_MACS", 0)
        monkeypatch.setattr(conv_input_factor, "_COST_RATIO", 10.0)
    else:
        monkeypatch.setattr(conv_input_factor, "_MIN_CHANNELS", 10**9)

    def counted(module, x):
        calls.append(type(module))
        return correlation_input_factor(module, x)

    monkeypatch.setattr(curvopt.layers.conv, "correlation_input_factor", counted)
    torch.manual_seed(0)
    model = make().to(DT)
    x = torch.randn(4, *shape, dtype=DT)
    with torch.no_grad():
        model(x)  # materialise the lazy layer
    model = curvopt.extend(model)
    out = model(x)
    loss = curvopt.extend(nn.CrossEntropyLoss())(out, torch.arange(4) % out.shape[1])
    torch.manual_seed(1)
    with curvopt.collect(extension):
        loss.backward()
    name = "kflr" if isinstance(extension, ext.KFLR) else "kfac"
    weights = [
        m.weight for m in model.modules() if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d))
    ]
    return [getattr(w, name) for w in weights], calls


NETS = {
    "conv2d": (
        lambda: nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1),
            nn.Tanh(),
            nn.Conv2d(4, 3, (2, 3), padding="same"),
            nn.Tanh(),
            nn.Conv2d(3, 2, 3, stride=2),  # stride 2: the unfolded route
            nn.Flatten(),
            nn.LazyLinear(3),
        ),
        (3, 7, 6),
        2,
    ),
    "conv1d": (
        lambda: nn.Sequential(
            nn.Conv1d(2, 3, 4, padding=2), nn.Tanh(), nn.Flatten(), nn.LazyLinear(3)
        ),
        (2, 9),
        1,
    ),
    "conv3d": (
        lambda: nn.Sequential(
            nn.Conv3d(2, 2, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.LazyLinear(3)
        ),
        (2, 3, 4, 3),
        1,
    ),
}


@pytest.mark.parametrize("net", NETS)
@pytest.mark.parametrize("extension", [ext.KFLR, ext.KFAC], ids=["KFLR", "KFAC"])
def test_kronecker_factors_through_the_correlations(net, extension, monkeypatch):
    make, shape, routed = NETS[net]
    unfolded, none = _factors(make, shape, extension(), monkeypatch, forced=False)
    correlated, calls = _factors(make, shape, extension(), monkeypatch, forced=True)
    assert not none and len(calls) == routed
    for a, b in zip(unfolded, correlated):
        torch.testing.assert_close(b[0], a[0], rtol=0, atol=0)  # B: unchanged
        torch.testing.assert_close(b[1], a[1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_reduce_and_groups_keep_the_unfolded_route(approx, monkeypatch):
    """Forced on, the correlations give the factor of the plain convolution for "expand"
    only, never that of the grouped one."""
    monkeypatch.setattr(conv_input_factor, "_MIN_CHANNELS", 1)
    monkeypatch.setattr(conv_input_factor, "_MIN_GRAM_MACS", 0)
    monkeypatch.setattr(conv_input_factor, "_COST_RATIO", 10.0)
    calls = []
    monkeypatch.setattr(
        curvopt.layers.conv,
        "correlation_input_factor",
        lambda module, x: calls.append(module) or correlation_input_factor(module, x),
    )
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1, groups=2), nn.Tanh(), nn.Conv2d(4, 2, 3))
    model = curvopt.extend(plain.to(DT))
    x = torch.randn(3, 4, 6, 6, dtype=DT)
    loss = curvopt.extend(nn.MSELoss())(model(x), torch.zeros(3, 2, 4, 4, dtype=DT))
    with curvopt.collect(ext.KFLR(kfac_approx=approx)):
        loss.backward()
    assert calls == ([model[2]] if approx == "expand" else [])
    assert model[0].weight.kflr[1].shape == (2, 18, 18)


@pytest.mark.parametrize(
    "conv, x_shape, pays",
    [
        (nn.Conv2d(16, 16, 3, padding=1), (32, 16, 16, 16), True),  # the default ResNet's blocks
        (nn.Conv2d(32, 64, 5, padding=2), (64, 32, 14, 14), True),  # 2C2D's second
        (nn.Conv2d(16, 16, 3, padding=1), (32, 16, 32, 32), True),
        (nn.Conv2d(96, 128, 3, padding=1), (64, 96, 6, 6), True),  # 96 channels on 6x6
        (nn.Conv2d(16, 16, 3, padding=1), (32, 16, 12, 12), True),  # a Gram of 1e8
        (nn.Conv2d(16, 16, 3, padding=1), (32, 16, 8, 8), False),  # one of 4e7
        (nn.Conv2d(16, 16, 5, padding=1), (32, 16, 8, 8), False),  # wide strips: 0.31
        (nn.Conv2d(3, 16, 3, padding=1), (32, 3, 16, 16), False),  # few channels
        (nn.Conv2d(64, 96, 3), (64, 64, 14, 14), False),  # no padding: wide strips
        (nn.Conv2d(16, 16, 3, padding=1), (8, 16, 8, 8), False),  # too small to recover
        (nn.Conv2d(16, 16, 1), (32, 16, 16, 16), False),  # 1x1: nothing to save
        (nn.Conv2d(16, 16, 3, padding=1, stride=2), (32, 16, 16, 16), False),
        (nn.Conv2d(16, 16, 3, padding=2, dilation=2), (32, 16, 16, 16), False),
        (nn.Conv2d(16, 16, 3, padding=1, groups=2), (32, 16, 16, 16), False),
        (nn.Conv2d(16, 16, 3, padding=1, padding_mode="reflect"), (32, 16, 16, 16), False),
        (nn.Conv2d(512, 4, 3, padding=1), (1, 512, 16, 16), False),  # N L < C k: a root
    ],
)
def test_shape_rule(conv, x_shape, pays):
    assert correlation_pays(conv, torch.empty(x_shape)) is pays


def test_shape_rule_keeps_half_precision_on_the_unfolded_route():
    conv = nn.Conv2d(16, 16, 3, padding=1)
    assert not correlation_pays(conv, torch.empty(32, 16, 16, 16, dtype=torch.bfloat16))
