"""The probes of ``rows.establish``: ``k`` columns (``rows.probe_sets``, fewer than two per
bit of the sample index) propagated a few at a time. Every set is still probed (a leak
between two samples that only the last propagation separates raises), no propagation holds
more than ``rows._PROBES_PER_CALL`` columns, and the sets separate every ordered pair."""

import math

import pytest
import torch
from torch import nn

import curvopt
from curvopt import extensions as ext
from curvopt.engine import rows
from curvopt.errors import UnsupportedModuleError

DT = torch.float64


@pytest.mark.parametrize("n", [2, 3, 5, 8, 13, 64, 100, 257])
def test_probe_sets_separate_every_pair(n):
    """For all samples ``s != m`` some set holds ``s`` and not ``m`` (what lets a leak from a
    row of ``s`` into ``m`` show), with fewer sets than two per bit from ``n = 3`` on."""
    sets = rows.probe_sets(n)
    k = sets.shape[1]
    assert sets.shape == (n, k) and sets.dtype == torch.bool
    separated = (sets[:, None, :] & ~sets[None, :, :]).any(2)  # [s, m]
    assert bool(separated[~torch.eye(n, dtype=torch.bool)].all())
    assert math.comb(k, k // 2) >= n > math.comb(k - 1, (k - 1) // 2)
    assert k <= 2 * math.ceil(math.log2(n)) and (n < 3 or k < 2 * math.ceil(math.log2(n)))


class _Pair(nn.Module):
    """Adds to sample ``s`` ``weight`` times the hidden units of sample ``m`` (one way: a
    probe on ``s``'s rows leaks into ``m``, none on ``m``'s into ``s``)."""

    def __init__(self, s, m, weight):
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 3)
        self.s, self.m, self.weight = s, m, weight

    def forward(self, x):
        h = torch.tanh(self.a(x))
        source = torch.arange(len(x))
        source[self.s] = self.m
        return self.b(h + self.weight * (source != torch.arange(len(x)))[:, None] * h[source])


@pytest.fixture
def propagated(monkeypatch):
    """The number of probe columns of every propagation of ``rows``."""
    counts = []
    to_calls = rows.to_calls

    def counted(source, calls, columns, batched, walk):
        counts.append(len(columns))
        return to_calls(source, calls, columns, batched, walk)

    monkeypatch.setattr(rows, "to_calls", counted)
    return counts


def _pass(model, n, extension, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 4, generator=gen, dtype=DT), torch.randint(0, 3, (n,), generator=gen)
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    with curvopt.collect(extension()):
        lossfunc(model(x), y).backward()


def _sizes(n):
    k = rows.probe_sets(n).shape[1]
    step = rows._PROBES_PER_CALL
    return [min(step, k - first) for first in range(0, k, step)]


def _last_pair(n):
    """Samples ``s``, ``m`` that only the last propagation's sets separate as the leak of
    :class:`_Pair` needs (a set holding ``s`` and not ``m``): every earlier set holding ``s``
    holds ``m`` too."""
    sets = rows.probe_sets(n)
    last = (len(_sizes(n)) - 1) * rows._PROBES_PER_CALL
    for s in range(n):
        for m in range(n):
            earlier = bool((sets[s, :last] & ~sets[m, :last]).any())
            if s != m and not earlier and bool((sets[s, last:] & ~sets[m, last:]).any()):
                return s, m
    raise AssertionError("no such pair")


@pytest.mark.parametrize("n", [6, 13, 64])
@pytest.mark.parametrize("extension", [ext.BatchGrad, ext.DiagGGNExact])
def test_a_leak_only_the_last_propagation_separates_raises(propagated, n, extension):
    s, m = _last_pair(n)
    model = curvopt.extend(_Pair(s, m, 0.5).to(DT))
    with pytest.raises(UnsupportedModuleError, match="mixes samples"):
        _pass(model, n, extension)
    assert propagated == _sizes(n)  # every propagation ran, each of a few columns
    assert max(propagated) <= rows._PROBES_PER_CALL
    assert not hasattr(model.a.weight, extension.quantity.attr)


@pytest.mark.parametrize("n", [2, 5, 64])
def test_probes_go_a_few_columns_at_a_time_and_pass(propagated, n):
    """Samples that do not mix (weight 0): every set probed, ``_PROBES_PER_CALL`` columns at
    a time, the layout verified and the quantities written."""
    model = curvopt.extend(_Pair(0, n - 1, 0.0).to(DT))
    _pass(model, n, ext.BatchGrad)
    assert propagated == _sizes(n)
    assert sum(propagated) == rows.probe_sets(n).shape[1]
    assert model.a.weight.grad_batch.shape == (n, 6, 4)
