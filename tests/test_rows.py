"""The probes of ``rows.establish``, propagated a bit of the sample index at a time: every bit
is still probed (a leak between two samples that differ only in the last bit raises), and no
propagation holds more than the columns of ``rows._PROBE_BITS`` bits."""

import math

import pytest
import torch
from torch import nn

import curvopt
from curvopt import extensions as ext
from curvopt import rows
from curvopt.errors import UnsupportedModuleError

DT = torch.float64


class _Partner(nn.Module):
    """Adds to each sample's hidden units those of its partner ``n ^ (1 << bit)`` where it
    exists: samples that differ in that one bit of their index mix, no others."""

    def __init__(self, bit, weight):
        super().__init__()
        self.a, self.b, self.bit, self.weight = nn.Linear(4, 6), nn.Linear(6, 3), bit, weight

    def forward(self, x):
        h = torch.tanh(self.a(x))
        index = torch.arange(len(x))
        partner = index ^ (1 << self.bit)
        exists = (partner < len(x))[:, None]
        return self.b(h + self.weight * torch.where(exists, h[partner.clamp(max=len(x) - 1)], 0))


@pytest.fixture
def propagated(monkeypatch):
    """The number of probe columns of every propagation of ``rows``."""
    counts = []
    to_calls = rows.to_calls

    def counted(source, calls, columns, batched):
        counts.append(len(columns))
        return to_calls(source, calls, columns, batched)

    monkeypatch.setattr(rows, "to_calls", counted)
    return counts


def _pass(model, n, extension, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 4, generator=gen, dtype=DT), torch.randint(0, 3, (n,), generator=gen)
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    with curvopt.collect(extension()):
        lossfunc(model(x), y).backward()


@pytest.mark.parametrize("n", [8, 13])
@pytest.mark.parametrize("extension", [ext.BatchGrad, ext.DiagGGNExact])
def test_a_leak_in_the_last_bit_raises(propagated, n, extension):
    """Samples mixed with their partner in the highest bit of the index (for ``n = 13`` only
    those whose partner exists: 0..4 with 8..12) are caught by the last propagation only."""
    bits = math.ceil(math.log2(n))
    model = curvopt.extend(_Partner(bits - 1, 0.5).to(DT))
    with pytest.raises(UnsupportedModuleError, match="mixes samples"):
        _pass(model, n, extension)
    assert propagated == [2 * rows._PROBE_BITS] * math.ceil(bits / rows._PROBE_BITS)
    assert not hasattr(model.a.weight, extension.quantity.attr)


@pytest.mark.parametrize("n", [2, 5, 64])
def test_probes_go_a_few_columns_at_a_time_and_pass(propagated, n):
    """Samples that do not mix (weight 0 on the partner): every bit probed, in propagations
    of ``2 _PROBE_BITS`` columns, the layout verified and the quantities written."""
    bits = max(1, math.ceil(math.log2(n)))
    model = curvopt.extend(_Partner(0, 0.0).to(DT))
    _pass(model, n, ext.BatchGrad)
    sizes = [2 * min(rows._PROBE_BITS, bits - b) for b in range(0, bits, rows._PROBE_BITS)]
    assert propagated == sizes
    assert sum(propagated) == 2 * bits
    assert model.a.weight.grad_batch.shape == (n, 6, 4)
