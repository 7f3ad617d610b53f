"""The recipe "add a quantity" of docs/extending.md, followed with toy quantities declared in
this file and made by existing producers: a per-sample squared gradient norm (first order) and
a per-sample GGN diagonal under a new name (second order). Each works through ``collect``,
combines across micro-batches as its declaration says, is checked by ``verify``; and a quantity
cannot be declared without saying how it combines."""

import pytest
import torch
from conftest import DT, ggn_reference, per_sample_grads_loop
from torch import nn

import curvopt
from curvopt import extensions as ext
from curvopt.engine.accumulate import Accumulator
from curvopt.extensions import Combine, Extension, Kind, Producer, Quantity


class ToySquaredNorms(Extension):
    """``p.toy_sq_norms[n] = ||g_n||^2``: a second quantity of the squared-norms producer."""

    quantity = Quantity(
        "toy_sq_norms",
        Kind.PER_SAMPLE,
        Combine.CONCATENATE,
        Producer.SQUARED_NORMS,
        reference=lambda g: g.flatten(1).pow(2).sum(1),
    )


class ToyDiagGGNBatch(ext.BatchDiagGGNExact):
    """``p.toy_diag_batch``: the per-sample GGN diagonal, written under another name."""

    quantity = Quantity(
        "toy_diag_batch", Kind.PER_SAMPLE, Combine.CONCATENATE, Producer.GGN_DIAGONAL
    )


def _problem(n=6):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DT)
    X, y = torch.randn(n, 4, dtype=DT), torch.randint(0, 3, (n,))
    return model, nn.CrossEntropyLoss(reduction="sum"), X, y


def _run(model, lossfunc, X, y, extensions, chunks=1):
    with curvopt.collect(*extensions):
        for Xi, yi in zip(X.chunk(chunks), y.chunk(chunks)):
            lossfunc(model(Xi), yi).backward()
    return {k: p for k, p in model.named_parameters()}


@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_toy_first_order_quantity(chunks):
    """One pass and micro-batches: ``||g_n||^2`` of all samples, concatenated (a quantity
    summed by mistake would have shape ``[]`` or ``[N/chunks]``)."""
    plain, lossfunc, X, y = _problem()
    grads = per_sample_grads_loop(plain, lossfunc, X, y)
    model, lossfunc = curvopt.extend(plain), curvopt.extend(lossfunc)
    params = _run(model, lossfunc, X, y, [ToySquaredNorms(), ext.BatchL2Grad()], chunks)
    for k, p in params.items():
        want = grads[k].flatten(1).pow(2).sum(1)
        torch.testing.assert_close(p.toy_sq_norms, want)
        torch.testing.assert_close(p.batch_l2, want)
        assert p.toy_sq_norms.data_ptr() != p.batch_l2.data_ptr()  # never aliased


@pytest.mark.parametrize("chunks", [1, 2])
def test_toy_second_order_quantity(chunks):
    plain, lossfunc, X, y = _problem()
    _, per_sample = ggn_reference(plain, lossfunc, X, y)
    model, lossfunc = curvopt.extend(plain), curvopt.extend(lossfunc)
    params = _run(model, lossfunc, X, y, [ToyDiagGGNBatch(), ext.DiagGGNExact()], chunks)
    for k, p in params.items():
        torch.testing.assert_close(p.toy_diag_batch, per_sample[k])
        torch.testing.assert_close(p.diag_ggn_exact, per_sample[k].sum(0))


def test_toy_quantities_are_verified():
    """``verify`` checks the toy quantities against its own reference (the first-order one from
    the declared ``reference``, the diagonal from its producer and kind)."""
    plain, lossfunc, X, y = _problem(4)
    model, lossfunc = curvopt.extend(plain), curvopt.extend(lossfunc)
    errors = curvopt.verify(model, lossfunc, X, y, [ToySquaredNorms(), ToyDiagGGNBatch()])
    assert set(errors["0.weight"]) == {"toy_sq_norms", "toy_diag_batch"}
    assert max(e for per in errors.values() for e in per.values()) < 1e-10


def test_a_quantity_cannot_be_declared_without_its_combine_rule():
    with pytest.raises(TypeError, match="combine"):
        Quantity("no_rule", Kind.PER_SAMPLE, producer=Producer.SQUARED_NORMS)
    with pytest.raises(TypeError, match="combine"):
        Quantity("no_rule", Kind.PER_SAMPLE, None, Producer.SQUARED_NORMS)
    with pytest.raises(TypeError, match="declar"):

        class Undeclared(Extension):  # an attribute alone says nothing about combining
            attr = "undeclared"


def test_declarations_are_unique_and_looked_up_by_name():
    assert ext.quantity("grad_batch") is ext.BatchGrad.quantity
    assert ext.quantity("kfra").combine is Combine.RAISES
    assert ext.quantity("kfac_diagonal").combine is Combine.ADD  # skip_unsupported="diagonal"
    with pytest.raises(ValueError, match="declared twice"):
        ext.declare(Quantity("grad_batch", Kind.SUMMED, Combine.ADD, Producer.SUM_OF_SQUARES))
    with pytest.raises(KeyError, match="no quantity p.nothing"):
        Accumulator().combine(torch.zeros(1), "nothing", torch.zeros(1), 1)


def test_extensions_are_looked_up_by_the_attribute_they_write():
    """One lookup by name (``extensions.extension``) serves optim, linalg and experiments; a toy
    quantity declared in this file is found like a shipped one, and only Monte-Carlo extensions
    take ``mc_samples``."""
    assert ext.writer("toy_sq_norms") is ToySquaredNorms
    assert ext.extension("kfac", mc_samples=3).key() == ext.KFAC(mc_samples=3).key()
    assert ext.extension("kflr", mc_samples=3).key() == ext.KFLR().key()
    assert ext.extension("diag_ggn_mc").key() == ext.DiagGGNMC(mc_samples=1).key()
    assert type(ext.extension("grad_batch")) is ext.BatchGrad
    with pytest.raises(KeyError, match="no extension writes p.kfca"):
        ext.extension("kfca")


def test_optimizers_collect_the_extensions_their_curvature_names():
    model = nn.Linear(3, 2)
    cases = [
        (curvopt.optim.KFAC, {"curvature": "kflr", "damping": 1}, [ext.KFLR()]),
        (curvopt.optim.KFAC, {"mc_samples": 2, "damping": 1}, [ext.KFAC(mc_samples=2)]),
        (curvopt.optim.DiagGGNNewton, {"curvature": "exact", "damping": 1}, [ext.DiagGGNExact()]),
        # the paper's basis: this step's own factors, made by the EKFAC quantity
        (curvopt.optim.EKFAC, {"curvature": "kflr", "damping": 1, "basis_source": "current"}, []),
        # the default, the last refresh's basis: the factors for the next one beside
        (curvopt.optim.EKFAC, {"curvature": "kflr", "damping": 1}, [ext.KFLR()]),
        (curvopt.optim.VarianceAdaptedSGD, {}, [ext.Variance(), ext.BatchL2Grad()]),
    ]
    for cls, options, expected in cases:
        opt = cls(model.parameters(), lr=0.1, **options)
        made, targets = opt._requests()
        if cls is curvopt.optim.EKFAC:  # in the bases the optimizer supplies between refreshes
            expected = [ext.EKFAC(factors="kflr", bases=opt._supplied), *expected]
        assert [e.key() for e in made] == [e.key() for e in expected]
        assert {attr for _, attr in targets} == {e.attr for e in made}


def test_every_combine_rule_is_implemented_and_every_shipped_quantity_declared():
    from curvopt.engine.accumulate import _COMBINE
    from curvopt.extensions.firstorder import FIRST_ORDER
    from curvopt.extensions.secondorder import SECOND_ORDER

    assert set(_COMBINE) == set(Combine)
    for cls in (*FIRST_ORDER, *SECOND_ORDER):
        assert ext.quantity(cls.attr) is cls.quantity
        assert cls.order == cls.quantity.producer.order
