"""The settings train without diverging, each at 6 seeds (no test rides on one seed's
trajectory, nor on one CPU's rounding): ``lr=0.05, damping=1e-3`` (an absolute damping, the
curvature at every step) on the digits CNN, the zoo's models and the DeepOBS networks
(``DiagGGNNewton`` on logistic regression and 2C2D only: ``_README_CASES``); the defaults,
``lr=0.05`` and nothing else (the curvature every 10 steps, relative damping, the trust region),
on DeepOBS 2C2D and 3C3D.

The trust region (``kl_clip=1e-3`` by default: the step scaled by
``ν = min(1, sqrt(κ / (lr² gᵀd)))``) is what makes small dampings work; the paper's unclipped
update (``kl_clip=None``) diverges on the digits CNN at these settings. When a step fails, the
error names the optimizer, the cause and the options to change.
"""

import inspect
import math
from functools import partial

import pytest
import torch
from torch import nn

import curvopt
from curvopt.optim import EKFAC, KFAC, DiagGGNNewton
from benchmarks.default_robustness import PROBLEMS, loss_ratio, steps_and_target
from benchmarks.ekfac_badly_scaled import LENGTH, VOCAB, badly_scaled_gpt, successor_task
from fixtures import zoo

#: an absolute damping (the curvature at every step) and the default trust region, kl_clip=1e-3
README = {"lr": 0.05, "damping": 1e-3}
PAPER = {"lr": 0.05, "damping": 1e-3, "kl_clip": None}
OPTIMIZERS = {"KFAC": KFAC, "DiagGGNNewton": DiagGGNNewton}
#: trained with the README settings too (the trust-region tests below are for the first two)
TRAINED = {**OPTIMIZERS, "EKFAC": partial(EKFAC, basis_interval=5)}
#: the defaults: ``cls(params, lr=0.05)``, nothing else (curvature every 10 steps, the damping
#: ``λ = 1e-2 s`` of ``KFAC`` and ``EKFAC``, ``DiagGGNNewton``'s relative one, the trust region)
DEFAULTS = {"KFAC": KFAC, "EKFAC": EKFAC, "DiagGGNNewton": DiagGGNNewton}
#: every trajectory test runs at each of these seeds: no test rides on one seed's luck (nor on
#: one CPU's rounding)
SEEDS = range(6)


def _digits():
    datasets = pytest.importorskip("sklearn.datasets")
    X, y = datasets.load_digits(return_X_y=True)
    return torch.tensor(X, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16, torch.tensor(y)


def _digits_cnn(seed=0):
    torch.manual_seed(seed)  # the initialisation and the Monte-Carlo draws
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(128, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def _train(opt, loss_of, X, y, steps, batch, seed=0):
    """``steps`` steps on random batches of ``(X, y)`` (their order from ``seed``); the loss on
    all of it before and after."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        first = loss_of(X, y).item()
    for _ in range(steps):
        index = torch.randint(0, len(X), (batch,), generator=generator)
        opt.zero_grad()
        loss = loss_of(X[index], y[index])
        with opt.collect():
            loss.backward()
        opt.step()
    with torch.no_grad():
        return first, loss_of(X, y).item()


@pytest.mark.parametrize("batch", [32, 128])
@pytest.mark.parametrize("name", list(TRAINED))
def test_readme_settings_train_the_digits_cnn(name, batch):
    """At each of 6 seeds (the initialisation, the Monte-Carlo draws and the batch order) the
    loss on the 1,797 digits halves within 40 steps."""
    X, y = _digits()
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    runs = []
    for seed in SEEDS:
        model = curvopt.extend(_digits_cnn(seed))
        opt = TRAINED[name](model.parameters(), **README)
        loss_of = lambda a, b, model=model: lossfunc(model(a), b)  # noqa: E731
        runs.append(_train(opt, loss_of, X, y, steps=40, batch=batch, seed=seed))
    assert all(math.isfinite(last) and last < 0.5 * first for first, last in runs), runs


def test_paper_update_diverges_on_the_digits_cnn_and_the_error_names_the_factor():
    """Without the trust region the README's settings blow up within a few steps (the reason it
    is on), at each of 6 seeds; the step that fails names the parameter and which Kronecker
    factor failed."""
    X, y = _digits()
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    match = r"parameter '.*' .*Kronecker factor [AB]"
    for seed in SEEDS:
        model = curvopt.extend(_digits_cnn(seed))
        opt = KFAC(model.named_parameters(), **PAPER)
        loss_of = lambda a, b, model=model: lossfunc(model(a), b)  # noqa: E731
        with pytest.raises(torch.linalg.LinAlgError, match=match) as error:
            _train(opt, loss_of, X, y, steps=40, batch=128, seed=seed)
        assert "kl_clip" in str(error.value)  # the option that keeps these settings training


@pytest.mark.parametrize("model_name", ["mlp", "resnet_block", "gpt", "bert"])
@pytest.mark.parametrize("name", list(TRAINED))
def test_readme_settings_train_zoo_models(name, model_name):
    """At each of 6 seeds (the 64 samples, the Monte-Carlo draws and the batch order) the loss
    on the samples falls by 5 % within 40 steps of batch 16."""
    runs = []
    for seed in SEEDS:
        problem = zoo.ZOO[model_name](dtype=torch.float32)
        model, lossfunc = curvopt.extend(problem.model), curvopt.extend(problem.lossfunc)
        X, y = problem.make_batch(64, seed)
        torch.manual_seed(seed)  # the Monte-Carlo draws
        opt = TRAINED[name](model.parameters(), **README)
        loss_of = partial(problem.loss_of, model, lossfunc=lossfunc)
        runs.append(_train(opt, loss_of, X, y, steps=40, batch=16, seed=seed))
    assert all(math.isfinite(last) and last < 0.95 * first for first, last in runs), runs


#: the README's settings, and EKFAC's with its trust region in the factors' eigenvalues
BADLY_SCALED = {
    **TRAINED,
    "EKFAC trust_metric='ggn'": partial(EKFAC, basis_interval=5, trust_metric="ggn"),
}


@pytest.mark.parametrize(
    "name, settings",
    [
        ("KFAC", "readme"),
        ("KFAC", "defaults"),
        ("EKFAC", "defaults"),
        ("EKFAC trust_metric='ggn'", "readme"),
        pytest.param(
            "EKFAC",
            "readme",
            marks=pytest.mark.xfail(
                strict=True,
                reason="EKFAC with a damping given measures its trust region in S "
                "(trust_metric='correction'), the empirical Fisher, 3e2-9e2 times the GGN "
                "here: it stalls at 12-17 (docs/optim.md, 'EKFAC from a badly scaled "
                "initialisation')",
            ),
        ),
    ],
)
def test_readme_settings_train_a_badly_scaled_gpt(name, settings):
    """The tiny GPT with its tied embedding at ``nn.Embedding``'s default ``N(0, 1)`` (logits of
    order ``sqrt(64)``: a first loss of 39-47; AdamW reaches 2.9-4.4 in 60 steps): at each of 6
    seeds the loss on the 64 sequences falls below a tenth of the first within 60 steps of
    batch 16. ``KFAC`` ends at 0.007-0.13 with the README's settings, at 0.14-0.70 at its
    defaults. ``EKFAC``'s ``S`` is the empirical Fisher's, 3e2-9e2 times the GGN's on this model
    (``python -m benchmarks.ekfac_badly_scaled``): at its defaults its trust region measures
    steps in the factors' eigenvalues (``trust_metric="ggn"``) and it ends at 0.03-1.1, with the
    README's settings and that metric named at 3e-6 to 0.05; with the README's settings alone
    (a damping given: the metric of ``S``) at 12-17 (a strict ``xfail``, which fails once it
    trains)."""
    vocab, length = VOCAB, LENGTH
    runs = []
    for seed in SEEDS:
        model = badly_scaled_gpt(seed)  # seeds the initialisation and the Monte-Carlo draws
        model, lossfunc = curvopt.extend(model), curvopt.extend(nn.CrossEntropyLoss())
        make = BADLY_SCALED[name] if settings == "readme" else DEFAULTS[name]
        opt = make(model.parameters(), **(README if settings == "readme" else {"lr": 0.05}))
        X, y = successor_task(vocab, length, seed)
        loss_of = lambda a, b, model=model, lossfunc=lossfunc: lossfunc(  # noqa: E731
            model(a).reshape(-1, vocab), b.reshape(-1)
        )
        runs.append(_train(opt, loss_of, X, y, steps=60, batch=16, seed=seed))
    assert all(math.isfinite(last) and last < 0.1 * first for first, last in runs), runs


# ----------------------------------------------------------------------------- the trust region


def _one_layer(seed=0):
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    layer = curvopt.extend(nn.Linear(4, 3).to(torch.float64))
    x = 3 * torch.randn(16, 4, dtype=torch.float64, generator=generator)
    y = torch.randint(0, 3, (16,), generator=generator)
    return layer, curvopt.extend(nn.CrossEntropyLoss()), x, y


@pytest.mark.parametrize("lr", [1e-3, 0.5])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_clipped_step_is_the_paper_step_scaled_into_the_trust_region(name, lr):
    """The default ``kl_clip=1e-3``: ``θ ← θ − lr ν d`` with
    ``ν = min(1, sqrt(1e-3 / (lr² Σ gᵀd)))`` and ``d`` the paper's direction, taken from a twin
    with ``kl_clip=None`` (the paper's update); ``ν < 1`` for the large ``lr``."""
    steps = {}
    for kl_clip in (None, "clipped"):
        layer, lossfunc, x, y = _one_layer()
        options = {"kl_clip": None} if kl_clip is None else {}
        opt = OPTIMIZERS[name](layer.parameters(), lr=lr, damping=1e-2, **options)
        before = [p.detach().clone() for p in layer.parameters()]
        torch.manual_seed(1)
        with opt.collect():
            lossfunc(layer(x), y).backward()
        grads = [p.grad.clone() for p in layer.parameters()]
        opt.step()
        steps[kl_clip] = [b - p.detach() for b, p in zip(before, layer.parameters())]
    paper = steps[None]
    total = sum(float((g * s / lr).sum()) for g, s in zip(grads, paper)) * lr**2
    nu = min(1.0, math.sqrt(1e-3 / total))
    assert (nu < 1) == (lr == 0.5)
    for clipped, full in zip(steps["clipped"], paper):
        torch.testing.assert_close(clipped, nu * full)


# ----------------------------------------------------------------------------- errors name causes


def test_a_closure_whose_loss_exploded_raises_and_changes_nothing():
    layer, lossfunc, x, y = _one_layer()
    opt = KFAC(layer.parameters(), **README)
    before = [p.detach().clone() for p in layer.parameters()]

    def closure():
        opt.zero_grad()
        loss = lossfunc(layer(x), y)
        loss.backward()
        return loss * math.inf

    with pytest.raises(FloatingPointError, match="loss exploded"):
        opt.step(closure)
    for p, b in zip(layer.parameters(), before):
        torch.testing.assert_close(p.detach(), b)


def test_a_non_finite_gradient_names_the_exploded_loss():
    layer, lossfunc, x, y = _one_layer()
    opt = DiagGGNNewton(layer.named_parameters(), **README)
    with opt.collect():
        lossfunc(layer(x), y).backward()
    layer.weight.grad[0, 0] = math.nan
    with pytest.raises(FloatingPointError, match=r"gradient of parameter 'weight'.*loss exploded"):
        opt.step()


@pytest.mark.parametrize("side, index", [("output-side Kronecker factor B", 0), ("input", 1)])
def test_a_factor_that_cannot_be_factorised_is_named(side, index):
    layer, lossfunc, x, y = _one_layer()
    opt = KFAC(layer.named_parameters(), lr=0.1, damping=0.0, curvature="kflr", kl_clip=None)
    with opt.collect():
        lossfunc(layer(x), y).backward()
    factors = [torch.eye(f.shape[0], dtype=torch.float64) for f in layer.weight.kflr]
    factors[index] = -factors[index]
    layer.weight.kflr = factors
    with pytest.raises(torch.linalg.LinAlgError, match=rf"parameter 'weight' .*{side}"):
        opt.step()


#: ``DiagGGNNewton`` at the absolute ``damping=1e-3`` is not robust on the conv nets and is not
#: among them: its diagonal misses the coupling of a filter's weights, so the trust region admits
#: steps that raise the loss by 10-80 %, and whether the last step lands on one decides the run
#: (3C3D: 9 of 12 seeds on target; All-CNN-C: 4 of 6; 2C2D: 6 of 6 on an Intel host, 4 of 6 on
#: an AMD host, whose rounding sent seeds 1 and 4 to 1.46 and 1.34 of the first loss). With a
#: tenth of the trust region it is (:func:`test_diagonal_newton_with_a_tighter_trust_region`);
#: ``docs/optim.md`` ("The defaults") gives the numbers; the README names the absolute damping
#: for ``KFAC``
_README_CASES = [
    pytest.param(name, problem, marks=[pytest.mark.slow] if problem == "cifar100_allcnnc" else [])
    for name, problems in {
        "KFAC": PROBLEMS,
        "DiagGGNNewton": ("mnist_logreg",),
        "EKFAC": ("mnist_logreg",),
    }.items()
    for problem in problems
]


@pytest.mark.parametrize("name, problem", _README_CASES)
def test_readme_settings_train_the_deepobs_networks(name, problem):
    """The DeepOBS networks on 64 images of a learnable task, at each of 6 seeds (the
    Monte-Carlo draws and the batch order: ``benchmarks.default_robustness.loss_ratio``): with
    these settings the loss on the set falls by 10 % within 30 steps (SGD with momentum and
    Adam halve it within 40 on all but All-CNN-C), and on All-CNN-C, which neither of them moves
    by more than 2 % in 40 steps, it stays finite and falls within 10 (two minutes on two
    cores: ``-m slow``)."""
    make = partial(TRAINED[name], **README)
    ratios = [loss_ratio(make, problem, seed) for seed in SEEDS]
    target = steps_and_target(problem)[1]
    assert all(math.isfinite(r) and r < target for r in ratios), ratios



@pytest.mark.parametrize("problem", ["fmnist_2c2d", "cifar10_3c3d"])
def test_diagonal_newton_with_a_tighter_trust_region(problem):
    """``DiagGGNNewton`` at the README's absolute ``damping=1e-3`` with a tenth of the default
    trust region (``kl_clip=1e-4``), the setting ``docs/optim.md`` gives for the conv nets: the
    loss falls by 10 % within 30 steps on 2C2D and 3C3D at each of 6 seeds, where the default
    ``kl_clip=1e-3`` lets a step that misses the filters' coupling decide the run."""
    make = partial(DiagGGNNewton, **README, kl_clip=1e-4)
    ratios = [loss_ratio(make, problem, seed) for seed in SEEDS]
    target = steps_and_target(problem)[1]
    assert all(math.isfinite(r) and r < target for r in ratios), ratios

#: the optimizers whose defaults the test runs on All-CNN-C too
ALLCNNC_DEFAULTS = ("KFAC", "EKFAC", "DiagGGNNewton")
_SLOW_DEFAULTS = {("EKFAC", "fmnist_2c2d"), *((n, "cifar100_allcnnc") for n in ALLCNNC_DEFAULTS)}

#: EKFAC on 2C2D eigendecomposes its 3136-wide input factor at each refresh, and All-CNN-C
#: takes 10 steps of 20-40 s: minutes on two cores, so they run with ``-m slow`` (they pass
#: there at every seed); All-CNN-C, which neither SGD nor Adam moves by more than 2 % in 40
#: steps, for the Kronecker optimizers, whose former relative damping diverged on it
_DEFAULT_CASES = [
    pytest.param(
        name,
        problem,
        marks=[pytest.mark.slow] if (name, problem) in _SLOW_DEFAULTS else [],
    )
    for name in DEFAULTS
    for problem in ("fmnist_2c2d", "cifar10_3c3d", "cifar100_allcnnc")
    if problem != "cifar100_allcnnc" or name in ALLCNNC_DEFAULTS
]


@pytest.mark.parametrize("name, problem", _DEFAULT_CASES)
def test_the_defaults_train_the_deepobs_networks_at_every_seed(name, problem):
    """At its defaults each optimizer lowers the loss on the set by 10 % within 30 steps of
    batch 16 at each of 6 seeds (the Monte-Carlo draws and the batch order; the loop of the
    README's swap, ``benchmarks.default_robustness.loss_ratio``); on All-CNN-C it stays finite
    and falls within 10 steps."""
    make = lambda params: DEFAULTS[name](params, lr=0.05)  # noqa: E731
    ratios = [loss_ratio(make, problem, seed) for seed in SEEDS]
    target = steps_and_target(problem)[1]
    assert all(math.isfinite(r) and r < target for r in ratios), ratios


@pytest.mark.parametrize("name", list(TRAINED))
def test_the_trust_region_is_on_by_default(name):
    cls = {"KFAC": KFAC, "DiagGGNNewton": DiagGGNNewton, "EKFAC": EKFAC}[name]
    assert inspect.signature(cls).parameters["kl_clip"].default == 1e-3
    assert cls([nn.Parameter(torch.zeros(2, 2))], 0.1, 0.1).defaults["kl_clip"] == 1e-3


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda p: KFAC(p, lr=0.1, damping=1e-2, curvature="kflr"),
        lambda p: KFAC(p, lr=0.1, damping=1e-2, curvature="kfac", kronecker_damping="exact"),
        lambda p: KFAC(p, 0.1, 1e-2, "kflr", kronecker_damping="trace_norm_eigh"),
        lambda p: EKFAC(p, lr=0.1, damping=1e-2, curvature="kflr"),
        lambda p: DiagGGNNewton(p, lr=0.1, damping=1e-2, curvature="exact"),
    ],
    ids=["kflr", "kfac-exact", "kflr-eigh", "EKFAC", "DiagGGNNewton"],
)
@pytest.mark.parametrize(
    "value, named",
    [(math.inf, r"gradient of parameter #0"), (1e200, r"`\w+` of parameter #0 \(shape \(5, 4\)\)")],
    ids=["inf", "overflow"],
)
def test_a_non_finite_input_raises_floating_point_error_naming_what(make_optimizer, value, named):
    """An ``inf`` in the data makes the first layer's gradient non-finite, a ``1e200`` its
    curvature (the input-side factor ``x xᵀ`` overflows) but not its gradient: the step raises
    ``FloatingPointError`` naming what is not finite, as the docstrings promise, for every
    optimizer (where an eigendecomposition or Cholesky factor met it first, the Kronecker ones
    used to raise its ``LinAlgError``), and changes nothing."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    model, lossfunc = curvopt.extend(model), curvopt.extend(nn.CrossEntropyLoss())
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    x[0, 0] = value
    opt = make_optimizer(model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    lossfunc(model(x), y).backward()
    assert torch.isfinite(model[0].weight.grad).all() == (value != math.inf)
    with pytest.raises(FloatingPointError, match=named):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_error_messages_name_the_optimizer_and_the_options_to_change():
    layer, lossfunc, x, y = _one_layer()
    opt = KFAC(layer.named_parameters(), **README)
    with opt.collect():
        lossfunc(layer(x), y).backward()
    layer.weight.grad[0, 0] = math.inf
    with pytest.raises(FloatingPointError, match=r"^KFAC: the gradient .*damping.*kl_clip"):
        opt.step()
