"""Every quantity of docs/conventions.md on every model of ``fixtures.zoo``, float64, both
reductions, against the independent torch.func references of ``tests/reference.py``.

A cell either returns the right numbers or raises the specific documented error with no
attribute written (``UNSUPPORTED``, from the README's support table). Nothing is xfailed.
Monte-Carlo quantities are checked with tolerances derived from the estimator's standard error
over independent passes (``assert_unbiased``), tight enough to catch a 10 % bias.
"""

from __future__ import annotations

import copy

import pytest
import reference
import torch
from attention_twin import twin_names, with_twins
from conftest import (
    ALL_ATTRS,
    DT,
    assert_close,
    assert_no_attributes,
    assert_unbiased,
    per_sample_grads_loop,
    trainable,
)

import curvopt
from curvopt import extensions as ext
from curvopt.errors import UnsupportedModuleError
from experiments import zoo as experiments_zoo
from fixtures import zoo

N = 3
MODELS = list(zoo.ZOO)
REDUCTIONS = ["mean", "sum"]

#: quantity name -> (extension factory, attribute)
QUANTITIES = {
    "BatchGrad": (ext.BatchGrad, "grad_batch"),
    "BatchL2Grad": (ext.BatchL2Grad, "batch_l2"),
    "SumGradSquared": (ext.SumGradSquared, "sum_grad_squared"),
    "Variance": (ext.Variance, "variance"),
    "DiagGGNExact": (ext.DiagGGNExact, "diag_ggn_exact"),
    "BatchDiagGGNExact": (ext.BatchDiagGGNExact, "diag_ggn_exact_batch"),
    "DiagHessian": (ext.DiagHessian, "diag_h"),
    "BatchDiagHessian": (ext.BatchDiagHessian, "diag_h_batch"),
    "KFLR-expand": (lambda: ext.KFLR(kfac_approx="expand"), "kflr"),
    "KFLR-reduce": (lambda: ext.KFLR(kfac_approx="reduce"), "kflr"),
    "KFRA": (ext.KFRA, "kfra"),
}
MC_QUANTITIES = {
    "DiagGGNMC": (ext.DiagGGNMC, "diag_ggn_mc"),
    "BatchDiagGGNMC": (ext.BatchDiagGGNMC, "diag_ggn_mc_batch"),
    "KFAC-expand": (lambda mc_samples: ext.KFAC(mc_samples, kfac_approx="expand"), "kfac"),
    "KFAC-reduce": (lambda mc_samples: ext.KFAC(mc_samples, kfac_approx="reduce"), "kfac"),
}

_KRON = ("KFLR-expand", "KFLR-reduce", "KFAC-expand", "KFAC-reduce")
_HESS = ("DiagHessian", "BatchDiagHessian")
_ALL = tuple(QUANTITIES) + tuple(MC_QUANTITIES)

#: (model, quantity) -> the documented error (README "What is supported and how the rest fails")
UNSUPPORTED = {
    # KFRA: feed-forward chains of Linear layers and elementwise activations only
    **{(m, "KFRA"): UnsupportedModuleError for m in MODELS if m != "mlp"},
    # DiagHessian: LayerNorm and attention are ops whose curvature it does not account for
    **{(m, q): UnsupportedModuleError for m in ("gpt", "bert", "vit", "seq_first") for q in _HESS},
    # Kronecker factors: the ViT's class token / positions (parameters of no Kronecker-factored
    # layer)
    **{("vit", q): UnsupportedModuleError for q in _KRON},
    # a parameter used outside its module (h @ tok.weight.T) is rejected by every quantity
    **{("gpt_functional", q): UnsupportedModuleError for q in _ALL},
}

#: weights used by several layers: KFAC's factors are the nearest Kronecker product of the sum
#: of the uses' products, nonlinear in the sampled factors (checked exactly for KFLR only)
_TIED = {"tok.weight"}

_CACHE: dict = {}


def _problem(name, reduction):
    """``(problem, X, y)`` with a fixed batch of ``N`` samples."""
    problem = zoo.ZOO[name](reduction)
    X, y = problem.make_batch(N, 0)
    return problem, X, y


def _reference(kind, name, reduction, *args):
    """Cached torch.func references (computed once per model, reduction and kind)."""
    key = (kind, name, reduction, *args)
    if key not in _CACHE:
        problem, X, y = _problem(name, reduction)
        fn = getattr(reference, kind)
        if kind == "kronecker":  # attention as its twin with nn.Linear projections
            twin = with_twins(problem.model)
            layers = fn(twin, problem.loss_on, X, y, problem.batch_dim, *args)
            renamed = twin_names(problem.model)
            weights = {id(p): renamed.get(k, k) for k, p in twin.named_parameters()}
            _CACHE[key] = [
                (weights[id(twin.get_submodule(layer).weight)], twin.get_submodule(layer), ba)
                for layer, ba in layers.items()
            ]
        else:
            _CACHE[key] = fn(problem.model, problem.loss_on, X, y, problem.batch_dim, *args)
    return _CACHE[key]


def _run(name, reduction, *extensions):
    """An extended copy of the zoo model after one backward pass inside ``collect``."""
    problem, X, y = _problem(name, reduction)
    model = curvopt.extend(copy.deepcopy(problem.model))
    lossfunc = curvopt.extend(copy.deepcopy(problem.lossfunc))
    loss = problem.loss_of(model, X, y, lossfunc)
    with curvopt.collect(*extensions):
        loss.backward()
    return model


def _check_unsupported(name, reduction, quantity, make):
    error = UNSUPPORTED[name, quantity]
    problem, X, y = _problem(name, reduction)
    model = curvopt.extend(copy.deepcopy(problem.model))
    lossfunc = curvopt.extend(copy.deepcopy(problem.lossfunc))
    loss = problem.loss_of(model, X, y, lossfunc)
    with pytest.raises(error) as info:
        with curvopt.collect(make()):
            loss.backward()
    assert len(str(info.value)) > 20, f"uninformative message: {info.value!r}"
    assert_no_attributes(model, ALL_ATTRS, f"{name} {quantity}: ")


# ------------------------------------------------------------------------------ expected values


def _nearest_kronecker(terms):
    """A weight tied across layers (API: one Kronecker product): the factors of the Kronecker
    product nearest to the sum of the uses' products (dense SVD of the rearranged sum), the
    first use's input-side factor scaled to the uses' mean trace there."""
    side = terms[0][0]
    f = [t[1] for t in terms]
    (a, b) = f[0][0].shape[0], f[0][1].shape[0]
    dense = sum(torch.kron(*t) for t in f)
    r = dense.reshape(a, b, a, b).permute(0, 2, 1, 3).reshape(a * a, b * b)
    u, sv, vh = torch.linalg.svd(r)
    factors = [(u[:, 0] * sv[0]).reshape(a, a), vh[0].reshape(b, b)]
    if torch.trace(factors[0]) < 0:
        factors = [-factors[0], -factors[1]]
    ratio = sum(torch.trace(t[side]) for t in f) / len(f) / torch.trace(factors[side])
    factors[side] = factors[side] * ratio
    factors[1 - side] = factors[1 - side] / ratio
    return factors


def _kronecker_expected(name, reduction, approx, model):
    """``param name -> expected factor list``: from the layer definitions for Linear / Conv2d /
    Embedding weights, the exact GGN block ``[G]`` for every 1-D parameter (biases, norms)."""
    layers = _reference("kronecker", name, reduction, approx)
    blocks, _ = _reference("ggn", name, reduction)
    uses = {}  # weight -> [(input side, factors in the weight's dim order)] in forward order
    for weight, module, (b, a) in layers:
        embedding = isinstance(module, torch.nn.Embedding)
        uses.setdefault(weight, []).append((0, [a, b]) if embedding else (1, [b, a]))
    expected = {}
    for pname, terms in uses.items():
        expected[pname] = terms[0][1] if len(terms) == 1 else _nearest_kronecker(terms)
    for pname, p in trainable(model).items():
        if p.dim() == 1:  # biases and norm scales: the exact block
            expected[pname] = [blocks[pname]]
    return expected


def _expected(name, reduction, quantity, model):
    """``param name -> expected value`` of the quantity's attribute."""
    if quantity in ("BatchGrad", "BatchL2Grad", "SumGradSquared", "Variance"):
        attr = QUANTITIES[quantity][1]
        ref = _reference("first_order", name, reduction)
        return {k: v[attr] for k, v in ref.items()}
    if quantity in ("DiagGGNExact", "BatchDiagGGNExact", "DiagGGNMC", "BatchDiagGGNMC"):
        blocks, per_sample = _reference("ggn", name, reduction)
        if quantity.startswith("Batch"):
            return per_sample
        return {k: torch.diagonal(b).reshape(per_sample[k].shape[1:]) for k, b in blocks.items()}
    if quantity in _HESS:
        diag, per_sample = _reference("hessian", name, reduction)
        return per_sample if quantity.startswith("Batch") else diag
    if quantity == "KFRA":
        problem, X, y = _problem(name, reduction)
        bs = reference.kfra_mlp(problem.model, problem.loss_on, X, y)
        kflr = _kronecker_expected(name, reduction, "expand", model)
        out = {}
        for i, b in zip((0, 2), bs):
            out[f"{i}.weight"] = [b, kflr[f"{i}.weight"][1]]
            out[f"{i}.bias"] = [b]  # KFRA's recursion: the bias gets the propagated B
        return out
    return _kronecker_expected(name, reduction, quantity.split("-")[1], model)


# ------------------------------------------------------------------------------ exact quantities


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("quantity", list(QUANTITIES))
@pytest.mark.parametrize("name", MODELS)
def test_exact(name, quantity, reduction):
    make, attr = QUANTITIES[quantity]
    if (name, quantity) in UNSUPPORTED:
        _check_unsupported(name, reduction, quantity, make)
        return
    model = _run(name, reduction, make())
    expected = _expected(name, reduction, quantity, model)
    params = trainable(model)
    assert set(expected) == set(params), f"reference covers {set(expected) ^ set(params)}"
    for pname, p in params.items():
        value = getattr(p, attr, None)
        if isinstance(expected[pname], list):
            assert isinstance(value, list), f"{pname}.{attr}: {type(value)}"
            assert len(value) == len(expected[pname]), f"{pname}.{attr}: {len(value)} factors"
            for i, (v, e) in enumerate(zip(value, expected[pname])):
                assert_close(v, e, f"{name} {pname}.{attr}[{i}]")
        else:
            assert_close(value, expected[pname], f"{name} {pname}.{attr}")


@pytest.mark.parametrize("quantity", ["KFLR-expand", "KFRA"])
def test_kronecker_single_sample_is_exact_block(quantity):
    """docs/conventions.md: with ``N = 1`` and no weight sharing, ``kron(*p.kflr)`` (and KFRA)
    is exact."""
    problem = zoo.mlp("mean")
    X, y = problem.make_batch(1, 3)
    model = curvopt.extend(copy.deepcopy(problem.model))
    loss = problem.loss_of(model, X, y, curvopt.extend(copy.deepcopy(problem.lossfunc)))
    make, attr = QUANTITIES[quantity]
    with curvopt.collect(make()):
        loss.backward()
    blocks, _ = reference.ggn(problem.model, problem.loss_on, X, y)
    for pname, p in trainable(model).items():
        factors = getattr(p, attr)
        full = factors[0] if len(factors) == 1 else torch.kron(*factors)
        assert_close(full, blocks[pname], f"{pname}.{attr}")


# ------------------------------------------------------------------------------ Monte-Carlo

PASSES = 10


#: Monte-Carlo samples per pass: enough for the power condition of ``assert_unbiased``
MC_SAMPLES = {"mlp": 1000, "resnet_block": 1000, "vit": 1000}
#: slow (several s each on 2 cores): the sequence models' Monte-Carlo cells except DiagGGNMC and
#: KFAC-expand with reduction "mean"
_SEQUENCE = ("gpt", "gpt_functional", "bert", "seq_first")
MC_CASES = [
    pytest.param(
        m,
        r,
        q,
        marks=[pytest.mark.slow]
        if m in _SEQUENCE and (r == "sum" or q in ("BatchDiagGGNMC", "KFAC-reduce"))
        else [],
    )
    for m in MODELS
    for r in REDUCTIONS
    for q in MC_QUANTITIES
]


#: collected together in each pass of a model and reduction: the draws are shared, and each
#: quantity's values are those of its pass alone (checked on the first pass)
SHARED_PASSES = ("DiagGGNMC", "KFAC-expand")


def _same_value(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))


@pytest.fixture(scope="module")
def mc_passes():
    """``(name, reduction, quantity) -> (model, {quantity: {param name: [value per pass]}})``:
    the ``PASSES`` passes (seeds ``0, 1, ...``) of ``quantity``, with the other supported
    quantities of ``SHARED_PASSES`` collected in the same passes, computed once for all of them
    (the Monte-Carlo draws of a pass serve them all); ``model`` is the last pass's."""
    cache: dict = {}

    def passes(name, reduction, quantity):
        together = (quantity,)
        if quantity in SHARED_PASSES:
            together = tuple(q for q in SHARED_PASSES if (name, q) not in UNSUPPORTED)
        key = (name, reduction, together)
        if key not in cache:
            mc = MC_SAMPLES.get(name, 1500)
            draws: dict = {q: {} for q in together}
            for seed in range(PASSES):
                torch.manual_seed(seed)
                extensions = [MC_QUANTITIES[q][0](mc_samples=mc) for q in together]
                model = _run(name, reduction, *extensions)
                for q in together:
                    for pname, p in trainable(model).items():
                        value = getattr(p, MC_QUANTITIES[q][1], None)
                        assert value is not None, f"{name} {pname}.{MC_QUANTITIES[q][1]}: missing"
                        draws[q].setdefault(pname, []).append(value)
            cache[key] = model, draws
        return cache[key]

    return passes


@pytest.mark.parametrize("name, reduction, quantity", MC_CASES)
def test_monte_carlo(name, quantity, reduction, mc_passes):
    make, attr = MC_QUANTITIES[quantity]
    mc = MC_SAMPLES.get(name, 1500)
    if (name, quantity) in UNSUPPORTED:
        _check_unsupported(name, reduction, quantity, lambda: make(mc_samples=mc))
        return
    model, shared = mc_passes(name, reduction, quantity)
    draws = shared[quantity]
    if len(shared) > 1:  # collected alone, the first pass draws and writes the same values
        torch.manual_seed(0)
        alone = _run(name, reduction, make(mc_samples=mc))
        for pname, p in trainable(alone).items():
            value = getattr(p, attr, None)
            assert value is not None, f"{name} {pname}.{attr}: missing"
            assert _same_value(value, draws[pname][0]), f"{name} {pname}.{attr}: alone"
    if quantity.startswith("KFAC"):
        expected = _kronecker_expected(name, reduction, quantity.split("-")[1], model)
        for pname, values in draws.items():
            if pname in _TIED:  # the nearest Kronecker product of sampled factors is biased
                continue
            exact = expected[pname]
            assert all(len(v) == len(exact) for v in values), f"{pname}.kfac: factor count"
            owner = model.get_submodule(pname.rpartition(".")[0])
            out = int(isinstance(owner, torch.nn.Embedding) and len(exact) == 2)  # [A, B]
            samples = torch.stack([v[out] for v in values])
            assert_unbiased(samples, exact[out], f"{name} {pname}.kfac output side")
            for v in values:
                if len(exact) == 2:  # the input side is not sampled
                    assert_close(v[1 - out], exact[1 - out], f"{name} {pname}.kfac input side")
        return
    expected = _expected(name, reduction, quantity, model)
    for pname, values in draws.items():
        assert_unbiased(torch.stack(values), expected[pname], f"{name} {pname}.{attr}")


def test_zoo_models_are_float64_and_deterministic():
    for name in MODELS:
        a, b = zoo.ZOO[name](), zoo.ZOO[name]()
        for (k, p), q in zip(a.model.named_parameters(), b.model.parameters()):
            assert p.dtype == DT and torch.equal(p, q), f"{name}.{k}"
        for x, z in zip(a.make_batch(2, 5), b.make_batch(2, 5)):
            assert torch.equal(x, z), name


@pytest.mark.parametrize("quantity", ["BatchGrad", "DiagGGNExact", "BatchDiagGGNExact"])
def test_sequence_first_with_batch_equal_to_length(quantity):
    """Issue 14 item 4: the sequence-first encoder with ``N == T`` (shapes cannot tell the
    batch from the sequence): the probes find the batch on dim 1, and the numbers are per
    sample of the model's batch."""
    problem = zoo.seq_first("mean", T=N)
    X, y = problem.make_batch(N, 0)
    model = curvopt.extend(copy.deepcopy(problem.model))
    loss = problem.loss_of(model, X, y, curvopt.extend(copy.deepcopy(problem.lossfunc)))
    make, attr = QUANTITIES[quantity]
    with curvopt.collect(make()):
        loss.backward()
    if quantity == "BatchGrad":
        want = reference.per_sample_grads(problem.model, problem.loss_on, X, y, 1)
    else:
        blocks, per_sample = reference.ggn(problem.model, problem.loss_on, X, y, 1)
        want = (
            per_sample
            if quantity.startswith("Batch")
            else {k: torch.diagonal(b).reshape(per_sample[k].shape[1:]) for k, b in blocks.items()}
        )
    for pname, p in trainable(model).items():
        assert_close(getattr(p, attr), want[pname], f"seq_first N == T {pname}.{attr}")


@pytest.mark.parametrize("name", MODELS)
def test_reference_agrees_with_loop_reference(name):
    """The vmap reference equals conftest's per-sample parameter copies (two independent
    constructions of ``g_n``), so a disagreement with curvopt is curvopt's."""
    problem, X, y = _problem(name, "mean")
    bd = problem.batch_dim
    loop = per_sample_grads_loop(problem.model, problem.loss_on, X, y, in_dim=bd, out_dim=bd)
    vmapped = reference.per_sample_grads(problem.model, problem.loss_on, X, y, bd)
    for pname, g in loop.items():
        assert_close(vmapped[pname], g, f"{name} {pname}")


@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_kronecker_reference_is_exact_for_one_sample(approx):
    """The Kronecker reference itself: ``kron(B, A)`` is the GGN block at ``N = 1``."""
    problem = zoo.mlp("sum")
    X, y = problem.make_batch(1, 5)
    blocks, _ = reference.ggn(problem.model, problem.loss_on, X, y)
    for layer, (b, a) in reference.kronecker(
        problem.model, problem.loss_on, X, y, 0, approx
    ).items():
        assert_close(torch.kron(b, a), blocks[f"{layer}.weight"], f"{layer}.weight")


def test_experiments_zoo_is_the_fixtures_zoo():
    """``experiments.zoo`` (the old name) re-exports :mod:`fixtures.zoo`: the same objects."""
    assert experiments_zoo.ZOO is zoo.ZOO and experiments_zoo.Problem is zoo.Problem
    assert all(getattr(experiments_zoo, f.__name__) is f for f in zoo.ZOO.values())
    assert experiments_zoo.GPT is zoo.GPT
