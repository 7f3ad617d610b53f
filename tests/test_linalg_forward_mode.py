"""``linalg``'s ``Jᵀ M J`` products with ``J V`` in forward mode, in float64 against the dense
``jacrev`` GGN (``test_linalg.dense_ggn``), and against the reverse-over-reverse path, which
they fall back to where the model has no forward-mode derivative."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_linalg import DT, TinyTransformer, assert_matrix, dense_ggn
from test_linalg import problem as linalg_problem
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import curvopt
from benchmarks import ggn_matvec_modes
from curvopt import linalg
from curvopt.linalg.autodiff import CHUNK
from experiments.overhead.problems import PROBLEMS
from fixtures import zoo


class Strided(nn.Module):
    """Convolutions with stride and padding, max-pooling, ReLU: ``[N, 1, 7, 7] -> [N, 3]``."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 3, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2, stride=1),
            nn.Conv2d(3, 2, 2, padding=1),
            nn.Tanh(),
            nn.Flatten(),
            nn.Linear(2 * 4 * 4, 3),
        )

    def forward(self, x):
        return self.net(x)


class Squared(torch.autograd.Function):
    """``x²`` with a backward (so reverse mode runs) but no forward-mode derivative."""

    @staticmethod
    def forward(x):
        return x * x

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


class NoForwardMode(nn.Module):
    """An MLP through :class:`Squared`, from its ``after``-th call on (0: always)."""

    def __init__(self, after=0):
        super().__init__()
        self.inp, self.out = nn.Linear(4, 5), nn.Linear(5, 3)
        self.after, self.calls = after, 0

    def forward(self, x):
        self.calls += 1
        h = self.inp(x)
        h = Squared.apply(h) if self.calls > self.after else h * h
        return self.out(h)


def _problem(name, reduction, n):
    """``(model, lossfunc, data)``, one batch of ``n`` samples."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    if name in ("mlp", "cnn", "residual"):
        return (*linalg_problem(name, reduction, sizes=(n,)), None)
    if name == "strided":
        model = Strided().to(DT)
        data = [(torch.randn(n, 1, 7, 7, generator=gen, dtype=DT), torch.randint(0, 3, (n,)))]
        loss = nn.CrossEntropyLoss(reduction=reduction)
    elif name == "sequence":  # logits [N, V, T], PyTorch's K-dim cross-entropy, ignored targets
        model = TinyTransformer().to(DT).eval()
        tokens = torch.randint(0, 5, (n, 3), generator=gen)
        targets = torch.randint(0, 5, (n, 3), generator=gen)
        targets[0, 1] = -1
        data = [(tokens, targets)]
        loss = nn.CrossEntropyLoss(reduction=reduction, ignore_index=-1)
    else:  # the zoo's GPT, rows [N·T, V] flattened, one target ignored (-100)
        gpt = zoo.gpt()
        model = gpt.model
        tokens, targets = gpt.make_batch(n, 0)
        data = [(tokens, targets.flatten())]
        assert (targets == -100).any()
        loss = nn.CrossEntropyLoss(reduction=reduction)
        return curvopt.extend(model), curvopt.extend(loss), data, lambda o: o.flatten(0, 1)
    return curvopt.extend(model), curvopt.extend(loss), data, None


ARCHITECTURES = ["mlp", "strided", "residual", "sequence", "gpt"]


@pytest.fixture(autouse=True)
def _math_attention():
    """The dense references differentiate attention twice: its math kernel."""
    with sdpa_kernel(SDPBackend.MATH):
        yield


def _reference(model, lossfunc, data, output):
    return dense_ggn(model if output is None else _Rows(model, output), lossfunc, data)


class _Rows(nn.Module):
    def __init__(self, model, output):
        super().__init__()
        self.model, self.output = model, output

    def forward(self, x):
        return self.output(self.model(x))


@pytest.mark.parametrize("name", ARCHITECTURES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("n", [1, 3])
def test_forward_mode_ggn_is_the_dense_ggn(name, reduction, n):
    model, lossfunc, data, output = _problem(name, reduction, n)
    G = linalg.GGN(model, lossfunc, data, output=output)
    dense = G.to_dense()  # P > CHUNK columns: several chunks, one M
    assert G.shape[0] > CHUNK and G.products.forward_mode, "the forward-mode path ran"
    assert_matrix(dense, _reference(model, lossfunc, data, output))


@pytest.mark.parametrize("name", ["mlp", "strided", "sequence"])
@pytest.mark.parametrize(
    "operator",
    [linalg.GGN, linalg.EmpiricalFisher, lambda *a, **k: linalg.FisherMC(*a, mc_samples=3, **k)],
    ids=["GGN", "EmpiricalFisher", "FisherMC"],
)
def test_forward_and_reverse_paths_agree(name, operator):
    """On two batches and ``K > CHUNK`` columns, the sampled ``M`` of ``FisherMC`` included."""
    model, lossfunc, data, _ = _problem(name, "mean", 3)
    data = data + _problem(name, "mean", 2)[2]
    forward, reverse = operator(model, lossfunc, data), operator(model, lossfunc, data)
    reverse.products.forward_mode = False
    V = np.random.default_rng(0).standard_normal((forward.shape[0], CHUNK + 7))
    expected = reverse.matmat(V)
    np.testing.assert_allclose(
        forward.matmat(V), expected, rtol=0, atol=1e-10 * abs(expected).max()
    )
    assert forward.products.forward_mode and not reverse.products.forward_mode


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_model_without_forward_mode_falls_back_to_the_same_matrix(reduction):
    model = curvopt.extend(NoForwardMode().to(DT))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss(reduction=reduction))
    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(4, 4, generator=gen, dtype=DT), torch.randint(0, 3, (4,), generator=gen))]
    G = linalg.GGN(model, lossfunc, data)
    assert_matrix(G.to_dense(), dense_ggn(model, lossfunc, data))
    assert not G.products.forward_mode  # remembered: later products go straight to reverse


def test_a_fallback_after_sampling_draws_the_same_fisher():
    """Forward mode refused only from the second chunk on, after ``M`` was drawn: the
    fallback's draws are the first ones (the RNG restored), as on the reverse path alone."""
    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(4, 4, generator=gen, dtype=DT), torch.randint(0, 3, (4,), generator=gen))]
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    torch.manual_seed(0)
    late = curvopt.extend(NoForwardMode(after=1).to(DT))
    torch.manual_seed(0)
    always = curvopt.extend(NoForwardMode().to(DT))
    F_late = linalg.FisherMC(late, lossfunc, data, mc_samples=2, seed=5)
    F_reverse = linalg.FisherMC(always, lossfunc, data, mc_samples=2, seed=5)
    F_reverse.products.forward_mode = False
    V = np.random.default_rng(1).standard_normal((F_late.shape[0], CHUNK + 1))
    np.testing.assert_allclose(F_late.matmat(V), F_reverse.matmat(V), rtol=0, atol=1e-12)
    assert late.calls == 3 and not F_late.products.forward_mode  # chunk 1, chunk 2, reverse


@pytest.mark.parametrize("name", ["2c2d", "gpt"])
def test_the_benchmarks_products_agree(name):
    """``benchmarks.ggn_matvec_modes`` times forward mode, reverse and curvlinops on products
    it first checks to agree (float32, batch 2), with forward mode not fallen back."""
    pytest.importorskip("curvlinops")
    named = ggn_matvec_modes.steps(PROBLEMS[name].resized(2))
    assert {"forward mode", "reverse", "curvlinops"} <= set(named)


def _batch_norm_model(track):
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(4, track_running_stats=track)
    model = nn.Sequential(nn.Linear(3, 4), norm, nn.Tanh(), nn.Linear(4, 2)).to(DT)
    return curvopt.extend(model), curvopt.extend(nn.CrossEntropyLoss())


def _batch_norm_data():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(6, 3, generator=g, dtype=DT), torch.randint(0, 2, (6,), generator=g))]


def test_batch_norm_updating_running_statistics_raises_naming_the_fix():
    model, lossfunc = _batch_norm_model(track=True)
    data = _batch_norm_data()
    G = linalg.GGN(model, lossfunc, data)
    with pytest.raises(curvopt.errors.UnsupportedModuleError, match=r"'1'.*model\.eval\(\)"):
        G @ np.ones(G.shape[1])
    model.eval()  # the model as it predicts: running statistics, nothing updated
    before = model[1].running_mean.clone()
    assert_matrix(G.to_dense(), dense_ggn(model, lossfunc, data))
    assert torch.equal(model[1].running_mean, before)


def test_batch_norm_with_batch_statistics_has_the_dense_ggn():
    model, lossfunc = _batch_norm_model(track=False)  # training mode, batch statistics
    data = _batch_norm_data()
    assert_matrix(linalg.GGN(model, lossfunc, data).to_dense(), dense_ggn(model, lossfunc, data))
