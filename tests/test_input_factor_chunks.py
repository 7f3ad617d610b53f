"""The input side of Kronecker factors within a memory budget.

A convolution's input-side factor ``A = mean_{n,l} x_nl x_nlᵀ`` needs the unfolded patches,
``prod(kernel)`` times the input: ``layers.kron.input_factor_by_samples`` builds it from chunks
of samples. And ``engine.kron_pass.FactorStream`` computes every input side after the last
chunk of propagated columns, so that no chunk is propagated while the input sides are held.
Both are checked against independent references (``F.unfold`` in float64) and against the
unchunked result.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import DT
from torch import nn

import curvopt
import curvopt.engine.curvature
from curvopt import extensions as ext
from curvopt.core.reductions import gram_root
from curvopt.layers import kron
from curvopt.layers.conv import ConvRule


def gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize("n", [1, 7])
def test_chunks_of_samples_add_up_to_the_whole_batch_factor(approx, n, monkeypatch):
    """Budget of 2.5 samples' inputs: chunks of 2, the last one shorter for n = 7."""
    x = torch.randn(n, 5, 3, dtype=DT, generator=gen(0))
    monkeypatch.setattr(kron, "_INPUT_BUDGET", 5 * 3 * 5 // 2)
    made = []

    def inputs_of(start, stop):
        made.append((start, stop))
        return x[start:stop]

    chunked = kron.input_factor_by_samples(inputs_of, n, 5, 3, approx)
    rows = x.mean(1) if approx == "reduce" else x.flatten(0, 1)
    torch.testing.assert_close(chunked, rows.T @ rows / rows.shape[0], rtol=1e-13, atol=1e-15)
    if n == 1:
        assert made == [(0, 1)]
    elif approx == "expand":
        assert made == [(0, 2), (2, 4), (4, 6), (6, 7)]
    else:  # 7 rows: more than the 3 features, chunked too
        assert made == [(0, 2), (2, 4), (4, 6), (6, 7)]


def test_a_batch_with_fewer_rows_than_features_is_not_chunked_and_keeps_its_root(monkeypatch):
    """Rank-deficient: the factor carries its root, which chunks would not add up to."""
    x = torch.randn(6, 2, 20, dtype=DT, generator=gen(1))  # 12 rows, 20 features
    monkeypatch.setattr(kron, "_INPUT_BUDGET", 40)
    made = []

    def inputs_of(start, stop):
        made.append((start, stop))
        return x[start:stop]

    factor = kron.input_factor_by_samples(inputs_of, 6, 2, 20, "expand")
    assert made == [(0, 6)]
    root = gram_root(factor)
    assert root is not None and root.shape[0] == 12
    torch.testing.assert_close(root.T @ root, factor, rtol=1e-13, atol=1e-15)


def _unfold_factor(conv, x, approx):
    """Reference ``A`` of a Conv2d from ``F.unfold`` (channel-major rows, as weight.flatten(1))."""
    patches = F.unfold(
        x, conv.kernel_size, dilation=conv.dilation, padding=conv.padding, stride=conv.stride
    )  # [N, C k, L]
    if approx == "reduce":
        mean = patches.mean(2)
        return mean.T @ mean / x.shape[0]
    rows = patches.transpose(1, 2).flatten(0, 1)
    return rows.T @ rows / rows.shape[0]


@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize(
    "options",
    [dict(), dict(stride=2, padding=1), dict(dilation=2, padding=2), dict(stride=(2, 1))],
)
def test_conv_input_factor_in_chunks_matches_unfold(options, approx, monkeypatch):
    conv = nn.Conv2d(3, 4, 3, **options).to(DT)
    x = torch.randn(9, 3, 8, 7, dtype=DT, generator=gen(2))
    call = curvopt.core.calls.Call(conv, (x,), {})
    whole = ConvRule().kron_input_factor(call, "weight", approx, 9)
    monkeypatch.setattr(kron, "_INPUT_BUDGET", 3 * 9 * 56 * 2)  # about 2 samples' patches
    chunked = ConvRule().kron_input_factor(call, "weight", approx, 9)
    reference = _unfold_factor(conv, x, approx)
    torch.testing.assert_close(whole, reference, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(chunked, reference, rtol=1e-12, atol=1e-14)


def _cnn(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(3, 4, 3, stride=2),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(36, 5),
    ).to(DT)
    x = torch.randn(6, 2, 8, 8, dtype=DT, generator=gen(seed + 1))
    y = torch.randint(0, 5, (6,), generator=gen(seed + 2))
    return curvopt.extend(model), curvopt.extend(nn.CrossEntropyLoss()), x, y


def _factors(quantity, column_budget=None, input_budget=None, monkeypatch=None):
    if column_budget is not None:
        monkeypatch.setattr(curvopt.engine.curvature, "_COLUMN_BUDGET", column_budget)
    if input_budget is not None:
        monkeypatch.setattr(kron, "_INPUT_BUDGET", input_budget)
    model, lossfunc, x, y = _cnn()
    torch.manual_seed(5)  # KFAC's sampled targets
    with curvopt.collect(quantity):
        lossfunc(model(x), y).backward()
    attr = quantity.attr
    return [[f.clone() for f in getattr(p, attr)] for p in model.parameters()]


@pytest.mark.parametrize("quantity", [ext.KFLR, ext.KFAC, lambda: ext.KFLR(kfac_approx="reduce")])
def test_engine_factors_from_many_chunks_equal_one_chunk(quantity, monkeypatch):
    """Columns in chunks of one column (the input sides after the last), patches in chunks of
    one sample: the factors of the unchunked pass."""
    whole = _factors(quantity())
    chunked = _factors(quantity(), 1, 1, monkeypatch)
    for mine, theirs in zip(chunked, whole):
        assert len(mine) == len(theirs)
        for a, b in zip(mine, theirs):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_input_sides_come_after_every_chunk_of_columns(monkeypatch):
    """The order of the factor computations in a KFLR pass of five chunks of columns: every
    output side first, then the input sides (and each input side once)."""
    monkeypatch.setattr(curvopt.engine.curvature, "_COLUMN_BUDGET", 1)
    order = []
    for rule in {curvopt.layers.rule_for(m) for m in (nn.Conv2d(1, 1, 1), nn.Linear(1, 1))}:
        for kind in ("kron_output_factor", "kron_input_factor"):
            original = getattr(type(rule), kind)

            def spy(self, call, *args, _original=original, _kind=kind):
                order.append((_kind, call.grad_out is None))
                return _original(self, call, *args)

            monkeypatch.setattr(type(rule), kind, spy)
    model, lossfunc, x, y = _cnn()
    with curvopt.collect(ext.KFLR()):
        lossfunc(model(x), y).backward()
    kinds = [k for k, _ in order]
    first_input = kinds.index("kron_input_factor")
    assert "kron_output_factor" not in kinds[first_input:]
    assert kinds.count("kron_input_factor") == 3  # one per weight
    assert kinds.count("kron_output_factor") == 5 * 6  # 5 chunks x 6 parameters
    assert all(no_columns for k, no_columns in order if k == "kron_input_factor")
