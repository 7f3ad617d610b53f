"""The special ways of propagating columns are chosen once, from the walk (``curvature.choose``):

* the curvature pass hands each group's columns to a strategy (``curvature.Direct`` or
  ``compress.HeadCut``) with a ``contribute(calls, outs)`` callback, and holds no special case
  of its own;
* whether a cut at a language model's head was found is kept in the structure's plan: a
  structure without one is not searched again, one with it has it found and its rows probed
  again on every pass;
* the max-pool stages of a pass are made once per root and edges asked, not once per chunk.
"""

import inspect

import torch
from torch import nn

import curvopt
from curvopt import extensions as ext
from curvopt.engine import compress, curvature
from curvopt.core import plans
from curvopt.graph import pooling

DT = torch.float64
N, T, D = 3, 4, 8


class Decoder(nn.Module):
    """Position-wise layers around a mix of positions, then a head of ``vocab`` outputs."""

    def __init__(self, vocab):
        super().__init__()
        self.inp, self.mix, self.head = nn.Linear(5, D), nn.Linear(T, T), nn.Linear(D, vocab)

    def forward(self, x):
        a = self.mix(torch.tanh(self.inp(x)).transpose(1, 2)).transpose(1, 2)
        return self.head(torch.tanh(a))


def _decoder_passes(vocab, passes, monkeypatch):
    """``passes`` KFLR and DiagGGNExact passes of one decoder; the strategies chosen and the
    calls of ``find_cut`` and ``row_probes``, per pass."""
    chosen, found, probed = [], [], []
    choose, find_cut, row_probes = curvature.choose, curvature.find_cut, compress.row_probes

    def noted(*args, **kwargs):
        strategy = choose(*args, **kwargs)
        chosen[-1].append(type(strategy).__name__)
        return strategy

    monkeypatch.setattr(curvature, "choose", noted)
    monkeypatch.setattr(curvature, "find_cut", lambda *a: found[-1].append(1) or find_cut(*a))
    monkeypatch.setattr(compress, "row_probes", lambda r: probed[-1].append(1) or row_probes(r))
    torch.manual_seed(0)
    model = curvopt.extend(Decoder(vocab).to(DT))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    x, y = torch.randn(N, T, 5, dtype=DT), torch.randint(vocab, (N * T,))
    for _ in range(passes):
        chosen.append([]), found.append([]), probed.append([])
        with curvopt.collect(ext.KFLR(), ext.DiagGGNExact()):
            lossfunc(model(x).reshape(-1, vocab), y).backward()
    return chosen, [len(f) for f in found], [len(p) for p in probed]


def test_the_curvature_pass_holds_no_special_case():
    for name in ("_narrower", "_propagate_cut", "_exact_rows", "_chunk_size", "columns"):
        assert not hasattr(curvature.CurvaturePass, name), name
    for strategy in (curvature.Direct, compress.HeadCut):
        parameters = inspect.signature(strategy.propagate).parameters
        assert list(parameters) == ["self", "columns", "contribute"]


def test_a_cut_is_found_and_probed_on_every_pass(monkeypatch):
    chosen, found, probed = _decoder_passes(11, 3, monkeypatch)
    assert chosen == [["HeadCut"]] * 3
    assert found == [1, 1, 1] and probed == [1, 1, 1]  # bound and checked again on every pass
    cuts = [p.cuts for p in plans.plan_cache().values() if p.cuts]
    assert (((N * T, 11), 11, True), True) in [c for plan in cuts for c in plan]


def test_no_cut_is_remembered_and_not_looked_for_again(monkeypatch):
    chosen, found, probed = _decoder_passes(5, 3, monkeypatch)  # 5 columns a row, d = 8
    assert chosen == [["Direct"]] * 3
    assert found == [1, 0, 0] and probed == [0, 0, 0]


class PooledCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.pool, self.fc = nn.Conv2d(2, 3, 3), nn.MaxPool2d(2), nn.Linear(12, 4)

    def forward(self, x):
        return self.fc(self.pool(torch.relu(self.conv(x))).flatten(1))


def test_pool_stages_made_once_per_pass_whatever_the_chunks(monkeypatch):
    made, scattered = [], []
    stages, transpose = pooling._stages, pooling.max_pool_transpose
    monkeypatch.setattr(pooling, "_stages", lambda *a: made.append(1) or stages(*a))
    monkeypatch.setattr(
        pooling, "max_pool_transpose", lambda n, c: scattered.append(1) or transpose(n, c)
    )
    per_column = 5 * (4 + 4 + 3 * 4 * 4)  # the loss input, the Linear and Conv2d outputs
    monkeypatch.setattr(curvature, "_COLUMN_BUDGET", 2 * per_column)
    torch.manual_seed(0)
    model = curvopt.extend(PooledCNN().to(DT))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    x, y = torch.randn(5, 2, 6, 6, dtype=DT), torch.randint(0, 4, (5,))
    for _ in range(2):  # the second pass: the row layout from the plan, no probes
        made.clear(), scattered.clear()
        with curvopt.collect(ext.DiagGGNExact()):
            lossfunc(model(x), y).backward()
    assert len(scattered) == 2  # 4 columns, two at a time: both chunks batched across the pool
    assert len(made) == 1  # one root, one set of edges: the stages made once
