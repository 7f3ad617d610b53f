"""A weight tied across modules (a language model's embedding and output layer) combines over
micro-batches, an optimizer's window and ``linalg``'s batches (``KFAC``, and ``EKFAC``, whose
bases are ``KFAC``'s eigenvectors) like one batch, exactly.

Its Kronecker factors are the nearest Kronecker product of its uses' sum, which does not add
over batches; each use's factors are kept (``values.KroneckerFactors.uses``), combined use by
use (output sides add, input sides average with the batch sizes) and the product made again.
References: one backward pass over the whole batch, float64, ``<= 1e-12`` relative. The
Monte-Carlo draws of ``KFAC`` are the same in both runs: one row's class is drawn from one
uniform number of the global generator, in row order, so two micro-batches after the same seed
draw what one batch of their rows draws.
"""

import copy
import io

import numpy as np
import pytest
import torch
from conftest import DT
from torch import nn

import curvopt
from curvopt import extensions as ext
from curvopt import linalg, optim
from curvopt.errors import AccumulationError
from fixtures import zoo

TOL = 1e-12
EXTENSIONS = {"kflr": ext.KFLR, "kfac": ext.KFAC}


class TiedHead(nn.Module):
    """``Embedding(V, d)`` whose weight is also the ``Linear(d, V)`` output layer's."""

    def __init__(self, vocab=6, d=4):
        super().__init__()
        self.emb, self.mix = nn.Embedding(vocab, d), nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(torch.tanh(self.mix(self.emb(idx))))


def _tiny():
    torch.manual_seed(0)
    model = TiedHead().to(DT)
    lossfunc = nn.CrossEntropyLoss()

    def make_batch(n, seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, 6, (n, 5), generator=g), torch.randint(0, 6, (n, 5), generator=g)

    def loss_on(logits, y):
        return lossfunc(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    return model, lossfunc, make_batch, loss_on


def _gpt():
    problem = zoo.gpt("mean")  # each batch ignores one row: equal halves of equal counts
    return problem.model, problem.lossfunc, problem.make_batch, problem.loss_on


MODELS = {"tied_head": _tiny, "gpt": _gpt}


def _halves(make_batch):
    (x1, y1), (x2, y2) = make_batch(3, 1), make_batch(3, 2)
    return (x1, y1), (x2, y2), (torch.cat([x1, x2]), torch.cat([y1, y2]))


def _rel(got, want):
    return float((got - want).norm() / want.norm())


def _assert_same_factors(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert _rel(g, w) <= TOL
    if len(got) == 2:
        assert _rel(torch.kron(*got), torch.kron(*want)) <= TOL


def _collected(model, loss_on, batches, extension, weight):
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(3)
    with curvopt.collect(extension):
        for x, y in batches:
            (weight * loss_on(model(x), y)).backward()
    return {name: list(getattr(p, extension.attr)) for name, p in model.named_parameters()}


@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize("attr", ["kflr", "kfac"])
@pytest.mark.parametrize("build", MODELS)
def test_micro_batches_give_one_batch_factors(build, attr, approx):
    model, lossfunc, make_batch, loss_on = MODELS[build]()
    model, _ = curvopt.extend(model), curvopt.extend(lossfunc)
    first, second, whole = _halves(make_batch)
    extension = EXTENSIONS[attr](kfac_approx=approx)
    want = _collected(model, loss_on, [whole], extension, 1.0)
    got = _collected(model, loss_on, [first, second], extension, 0.5)
    for name in want:
        _assert_same_factors(got[name], want[name])


@pytest.mark.parametrize("curvature", ["kflr", "kfac"])
@pytest.mark.parametrize("build", MODELS)
def test_an_accumulated_step_is_the_one_batch_step(build, curvature):
    model, lossfunc, make_batch, loss_on = MODELS[build]()
    curvopt.extend(lossfunc)
    first, second, whole = _halves(make_batch)
    steps = []
    for batches, weight in (([whole], 1.0), ([first, second], 0.5)):
        copied = curvopt.extend(copy.deepcopy(model))
        opt = optim.KFAC(copied.parameters(), lr=0.1, damping=1e-2, curvature=curvature)
        opt.zero_grad()
        torch.manual_seed(3)
        for x, y in batches:
            (weight * loss_on(copied(x), y)).backward()
        opt.step()
        steps.append([(q - p).detach() for q, p in zip(copied.parameters(), model.parameters())])
        saved = io.BytesIO()
        torch.save(opt.state_dict(), saved)
        saved.seek(0)
        torch.load(saved, weights_only=True)  # the state keeps plain lists (values.plain)
    for got, want in zip(steps[1], steps[0]):
        assert _rel(got, want) <= TOL


class Flat(nn.Module):
    """The logits as loss rows ``[N T, V]``, as ``linalg`` hands them to the loss."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, idx):
        out = self.model(idx)
        return out.reshape(-1, out.shape[-1])


@pytest.mark.parametrize("curvature", ["kflr", "kfac"])
@pytest.mark.parametrize("build", MODELS)
def test_linalg_kfac_over_two_batches_is_one_batch(build, curvature):
    model, lossfunc, make_batch, _ = MODELS[build]()
    model, lossfunc = curvopt.extend(Flat(model)), curvopt.extend(lossfunc)
    (x1, y1), (x2, y2), (x, y) = _halves(make_batch)
    rows = [(x1, y1.reshape(-1)), (x2, y2.reshape(-1))]
    one = linalg.KFAC(model, lossfunc, [(x, y.reshape(-1))], curvature=curvature)
    two = linalg.KFAC(model, lossfunc, rows, curvature=curvature)
    for got, want in zip(two.factors, one.factors):
        _assert_same_factors(got, want)
    v = np.random.default_rng(0).standard_normal((one.shape[0], 3))
    want = one.matmat(v)
    assert np.linalg.norm(two.matmat(v) - want) <= TOL * np.linalg.norm(want)


class Repeated(nn.Module):
    """One ``Linear`` applied ``times`` times (set per call): a weight whose uses change."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(3, 3)
        self.times = 2

    def forward(self, x):
        for _ in range(self.times):
            x = torch.tanh(self.layer(x))
        return x


def test_passes_using_a_weight_in_other_calls_raise():
    torch.manual_seed(0)
    model = curvopt.extend(Repeated().to(DT))
    lossfunc = curvopt.extend(nn.MSELoss())
    x, y = torch.randn(4, 3, dtype=DT), torch.randn(4, 3, dtype=DT)
    with curvopt.collect(ext.KFLR()):
        lossfunc(model(x), y).backward()
        model.times = 3
        with pytest.raises(AccumulationError, match="layer#3"):
            lossfunc(model(x), y).backward()


@pytest.mark.parametrize("build", MODELS)
def test_linalg_ekfac_over_two_batches_is_one_batch(build):
    """``linalg.EKFAC``'s bases are the eigenvectors of ``linalg.KFAC``'s factors over all of
    ``data`` (the tied weight's: those of the nearest Kronecker product of the combined uses)."""
    model, lossfunc, make_batch, _ = MODELS[build]()
    model, lossfunc = curvopt.extend(Flat(model)), curvopt.extend(lossfunc)
    (x1, y1), (x2, y2), (x, y) = _halves(make_batch)
    rows = [(x1, y1.reshape(-1)), (x2, y2.reshape(-1))]
    one = linalg.EKFAC(model, lossfunc, [(x, y.reshape(-1))], curvature="kflr")
    two = linalg.EKFAC(model, lossfunc, rows, curvature="kflr")
    v = np.random.default_rng(0).standard_normal((one.shape[0], 3))
    want = one.matmat(v)
    assert np.linalg.norm(two.matmat(v) - want) <= TOL * np.linalg.norm(want)
