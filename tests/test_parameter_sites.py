"""Raw parameters of a module read where they meet the batch (``engine.parameter_sites``), float64.

A model that owns raw tokens (a class token expanded over the batch, position embeddings added
to every sample, a bias added over the positions) gets its first-order quantities from the
gradient at that add or expand instead of re-running the whole model sample by sample (the
generic rule): checked against ``torch.func`` per-sample gradients (``tests/reference.py``) for
both reductions and batches of 1 and 3, with the generic rule's re-runs counted. A parameter
used in two places, or not through an add or expand, still takes the generic rule.
"""

import ast
import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import DT, assert_close
from reference import first_order
from torch import nn

import curvopt
from curvopt import extensions as ext
from curvopt.graph.broadcast import Broadcast
from curvopt.layers.generic import GenericRule

T, D = 4, 5
QUANTITIES = [ext.BatchGrad, ext.BatchL2Grad, ext.SumGradSquared, ext.Variance]


class _Tokens(nn.Module):
    """``x [N, T-1, 3]`` -> embed, a class token in front, positions added (``[1, T, D]``, and
    ``[T, D]`` without the leading 1) (``use``: how else a raw parameter is used)."""

    def __init__(self, use="sites"):
        super().__init__()
        self.use = use
        self.embed, self.mix, self.head = nn.Linear(3, D), nn.Linear(D, D), nn.Linear(D, 2)
        self.cls = nn.Parameter(torch.randn(1, 1, D))
        self.pos = nn.Parameter(torch.randn(1, T, D))
        self.table = nn.Parameter(torch.randn(T, D))
        if use != "sites":
            self.shift = nn.Parameter(torch.randn(D))

    def forward(self, x):
        h = self.embed(x)
        h = torch.cat([self.cls.expand(len(x), -1, -1), h], dim=1) + self.pos
        if self.use == "twice":  # pos in two places: no single site
            h = h + self.pos
        if self.use == "scaled":  # a product is not a site
            h = h * self.shift
        if self.use == "bias":  # broadcast over the positions too: not taken for a site
            h = h + self.shift
        h = torch.tanh(self.mix(h + self.table))
        return self.head(h.mean(1))


class _Repeated(_Tokens):
    """A raw parameter expanded along a new dim of size ``T`` that is not the batch (a stack
    of ``T`` copies, summed): with ``N == T`` its shapes look like a broadcast over samples.
    The site's reading does not match the rule's on the first pass, so the rule stays in use."""

    def __init__(self, use="sites"):
        super().__init__(use)
        self.copies = nn.Parameter(torch.randn(1, D))

    def forward(self, x):
        h = self.embed(x) + self.copies.expand(T, D).sum(0)
        h = torch.cat([self.cls.expand(len(x), -1, -1), h], dim=1) + self.pos
        return self.head(torch.tanh(self.mix(h + self.table)).mean(1))


def _counted(monkeypatch):
    """The number of generic re-runs, counted."""
    runs = []
    original = GenericRule._vmapped

    def counting(self, call, *args, **kwargs):
        runs.append(type(call.module).__name__)
        return original(self, call, *args, **kwargs)

    monkeypatch.setattr(GenericRule, "_vmapped", counting)
    return runs


def _check(use, reduction, n, monkeypatch, functional=False, model_class=None):
    """The generic rule's re-runs in the second pass of one structure (the first compares the
    sites' readings with the rule's), after checking both passes' quantities."""
    torch.manual_seed(0)
    plain = (model_class or _Tokens)(use).to(DT)
    x, y = torch.randn(n, T - 1, 3, dtype=DT), torch.arange(n) % 2
    lossfunc = nn.CrossEntropyLoss(reduction=reduction)
    want = first_order(plain, lossfunc, x, y)
    model = curvopt.extend(copy.deepcopy(plain))
    extended = curvopt.extend(copy.deepcopy(lossfunc))
    for _ in range(2):
        runs = _counted(monkeypatch)
        with curvopt.collect(*(q() for q in QUANTITIES)):
            out = model(x)
            loss = F.cross_entropy(out, y, reduction=reduction) if functional else extended(out, y)
            loss.backward()
        for name, p in model.named_parameters():
            for attr, value in want[name].items():
                assert_close(getattr(p, attr), value, f"{use} {name}.{attr}")
        monkeypatch.undo()
    return runs


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_raw_tokens_are_read_at_their_add_or_expand(reduction, n, monkeypatch):
    """At a batch of 1 nothing is broadcast over the batch (the add's operands have one shape):
    the generic rule, right as ever."""
    assert _check("sites", reduction, n, monkeypatch) == ([] if n > 1 else ["_Tokens"])


def test_with_a_functional_loss_too(monkeypatch):
    """No extended loss: the walk is the first module hook's (``BackwardPass._watch_upstream``)."""
    assert _check("sites", "mean", 3, monkeypatch, functional=True) == []


@pytest.mark.parametrize("use", ["twice", "scaled", "bias"])
def test_other_uses_take_the_generic_rule(use, monkeypatch):
    assert _check(use, "mean", 3, monkeypatch) == ["_Tokens"]


def test_a_site_whose_reading_does_not_match_is_not_used(monkeypatch):
    assert _check("sites", "sum", T, monkeypatch, model_class=_Repeated) == ["_Repeated"]


def test_micro_batches_concatenate(monkeypatch):
    torch.manual_seed(0)
    plain = _Tokens().to(DT)
    x, y = torch.randn(6, T - 1, 3, dtype=DT), torch.arange(6) % 2
    lossfunc = nn.CrossEntropyLoss(reduction="sum")
    want = first_order(plain, lossfunc, x, y)
    model, extended = curvopt.extend(copy.deepcopy(plain)), curvopt.extend(copy.deepcopy(lossfunc))
    runs = _counted(monkeypatch)
    with curvopt.collect(ext.BatchGrad(), ext.Variance()):
        for part in (slice(0, 3), slice(3, 6)):
            extended(model(x[part]), y[part]).backward()
    assert runs == ["_Tokens"]  # the first pass compares the readings, the second uses them
    for name, p in model.named_parameters():
        assert_close(p.grad_batch, want[name]["grad_batch"], name)
        assert_close(p.variance, want[name]["variance"], name)


def test_a_wrong_site_reading_is_never_used(monkeypatch):
    """A reading that doubles the per-sample gradients (which would still pass the sum check
    if it halved another parameter's) fails the first pass's comparison with the rule: both
    passes take the rule, and every quantity is right."""
    original = Broadcast.per_sample
    monkeypatch.setattr(Broadcast, "per_sample", lambda self, c: 2 * original(self, c))
    assert _check("sites", "mean", 3, monkeypatch) == ["_Tokens"]


#: three ``BatchGrad`` passes of a plain linear model with the garbage collector off, printing
#: the address of ``grad_batch`` after each
_FREED_PASSES = """
import gc, torch, curvopt
from torch import nn
from curvopt import extensions as ext
model = curvopt.extend(nn.Linear(4, 3).double())
lossfunc = curvopt.extend(nn.CrossEntropyLoss())
x, y = torch.randn(5, 4, dtype=torch.float64), torch.arange(5) % 3
pointers = []
gc.disable()
for _ in range(3):
    with curvopt.collect(ext.BatchGrad()):
        lossfunc(model(x), y).backward()
    pointers.append(model.weight.grad_batch.data_ptr())
print(pointers)
"""


def test_a_pass_is_freed_when_it_ends():
    """Nothing of a pass's site bookkeeping refers back to the pass: with the garbage collector
    off, the next pass of a plain linear model reuses its ``grad_batch`` buffer, as it does
    when the pass object is freed at once. In a fresh process: the objects other tests left
    (an optimizer an exception's traceback holds, armed) must not decide it."""
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run(
        [sys.executable, "-c", _FREED_PASSES], cwd=root, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    pointers = ast.literal_eval(run.stdout.strip().splitlines()[-1])
    assert pointers[1] == pointers[2], pointers
