"""The diagonal that stands in for missing Kronecker factors (``skip_unsupported="diagonal"``,
``optim.KFAC(fallback="diagonal")``), with and without a sub-batch, float64.

On the zoo ViT (raw class and position tokens owned by the model itself): the parameters without
a factorisation get, with ``KFLR(samples=K)``, the exact
GGN diagonal of the first ``K`` samples at the factors' scale (``N/K`` for ``reduction="sum"``,
the sub-batch's own mean for ``"mean"``), checked against the dense GGN of ``tests/reference.py``
on ``X[:K]``; without ``samples`` (or ``K >= N``), the whole batch's, bit for bit.
"""

import copy

import pytest
import torch
from torch import nn
from conftest import assert_close
from reference import ggn
from attention_twin import twin_names, with_twins

import curvopt
from curvopt import extensions as ext
from fixtures import zoo

N = 6
#: the ViT's parameters without Kronecker factors: the raw tokens
UNFACTORED = {"cls", "pos"}


def _collect(problem, x, y, extension, skip="diagonal"):
    model = curvopt.extend(copy.deepcopy(problem.model))
    lossfunc = curvopt.extend(copy.deepcopy(problem.lossfunc))
    with curvopt.collect(extension, skip_unsupported=skip):
        lossfunc(model(x), y).backward()
    return model


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("k", [1, 4])
def test_fallback_diagonal_of_the_first_samples(reduction, k):
    problem = zoo.vit(reduction)
    x, y = problem.make_batch(N)
    model = _collect(problem, x, y, ext.KFLR(samples=k))
    blocks, _ = ggn(problem.model, problem.loss_on, x[:k], y[:k])
    c = N / k if reduction == "sum" else 1.0
    written = {n for n, p in model.named_parameters() if hasattr(p, "kflr_diagonal")}
    assert written == UNFACTORED
    for name, p in model.named_parameters():
        if name in UNFACTORED:
            want = c * torch.diagonal(blocks[name]).reshape(p.shape)
            assert_close(p.kflr_diagonal, want, name)
            assert not hasattr(p, "kflr")
        else:
            assert not hasattr(p, "kflr_diagonal")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_fallback_diagonal_of_the_whole_batch(reduction):
    problem = zoo.vit(reduction)
    x, y = problem.make_batch(N)
    whole = _collect(problem, x, y, ext.KFLR())
    covered = _collect(problem, x, y, ext.KFLR(samples=N + 1))
    blocks, _ = ggn(problem.model, problem.loss_on, x, y)
    for (name, p), q in zip(whole.named_parameters(), covered.parameters()):
        if name in UNFACTORED:
            assert_close(p.kflr_diagonal, torch.diagonal(blocks[name]).reshape(p.shape), name)
            assert torch.equal(p.kflr_diagonal, q.kflr_diagonal), name


def test_sub_batch_fallback_diagonal_uses_the_factors_columns():
    """``KFAC(samples=K)``'s Monte-Carlo diagonal is that of the whole-batch targets' first ``K``
    samples: ``N/K`` times the per-sample diagonals (``BatchDiagGGNMC`` drawn with the same seed)
    of those samples, under ``reduction="sum"``."""
    problem = zoo.vit("sum")
    x, y = problem.make_batch(N)
    torch.manual_seed(3)
    sub = _collect(problem, x, y, ext.KFAC(samples=2))
    torch.manual_seed(3)
    per_sample = _collect(problem, x, y, ext.BatchDiagGGNMC(), skip=False)
    for (name, p), q in zip(sub.named_parameters(), per_sample.parameters()):
        if name in UNFACTORED:
            assert_close(p.kfac_diagonal, N / 2 * q.diag_ggn_mc_batch[:2].sum(0), name)


class _Attender(nn.Module):
    """Tokens ``[N, T, 3]`` -> a linear embedding, ``nn.MultiheadAttention`` (two outputs:
    the output and the averaged weights), a linear head on the mean over tokens."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Linear(3, 8), nn.Linear(8, 3)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        h = self.embed(x)
        return self.head(self.attn(h, h, h)[0].mean(1))


def test_a_module_with_several_outputs_gets_its_factors_and_nothing_is_skipped():
    """``nn.MultiheadAttention`` with its two outputs: every parameter gets its factors, those
    of the twin with ``nn.Linear`` projections (``tests/attention_twin.py``), and
    ``skip_unsupported`` has nothing to skip."""
    torch.manual_seed(0)
    net, x, y = _Attender().double(), torch.randn(N, 4, 3, dtype=torch.float64), torch.arange(N) % 3
    problem = zoo.Problem(net, nn.CrossEntropyLoss(), None, None, None, 0)
    model = _collect(problem, x, y, ext.KFLR())
    twin = _collect(zoo.Problem(with_twins(net), nn.CrossEntropyLoss(), None, None, None, 0), x,
                    y, ext.KFLR())
    names = twin_names(net)
    expected = {names.get(k, k): p.kflr for k, p in twin.named_parameters()}
    for name, p in model.named_parameters():
        assert not hasattr(p, "kflr_diagonal"), name
        for got, want in zip(p.kflr, expected[name]):
            assert_close(got, want, name)


def test_optimizer_with_a_sub_batch_and_the_diagonal_fallback_steps():
    """``optim.KFAC(fallback="diagonal", curvature_samples=K)`` on the ViT: the raw tokens'
    step is ``g / (c + λ)`` with ``c`` the sub-batch's diagonal (no trust region, no momentum,
    trace-norm damping does not enter a diagonal block)."""
    problem = zoo.vit("mean")
    x, y = problem.make_batch(N)
    lr, damping = 0.1, 0.5
    model = curvopt.extend(copy.deepcopy(problem.model))
    lossfunc = curvopt.extend(copy.deepcopy(problem.lossfunc))
    opt = curvopt.optim.KFAC(
        model.parameters(),
        lr=lr,
        damping=damping,
        curvature="kflr",
        kl_clip=None,
        fallback="diagonal",
        curvature_samples=2,
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    lossfunc(model(x), y).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    reference = _collect(problem, x[:2], y[:2], ext.KFLR())  # "mean": the sub-batch's own mean
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if name in ("cls", "pos"):
            want = before[name] - lr * grads[name] / (q.kflr_diagonal + damping)
            assert_close(p.detach(), want, name)


@pytest.mark.parametrize("samples", [None, 8])
@pytest.mark.parametrize("model_name", ["vit", "seq_first"])
def test_kfac_with_the_diagonal_fallback_trains_attention_models(model_name, samples):
    """The README's KFAC settings with ``fallback="diagonal"`` on the zoo's models built on
    ``nn.MultiheadAttention`` (the ViT's raised before the attention's weights could be
    skipped), with and without a sub-batch: the training loss falls by 5 % in 40 steps of
    batch 16."""
    problem = zoo.ZOO[model_name](dtype=torch.float32)
    model, lossfunc = curvopt.extend(problem.model), curvopt.extend(problem.lossfunc)
    X, y = problem.make_batch(64, 0)
    opt = curvopt.optim.KFAC(
        model.parameters(), lr=0.05, damping=1e-3, fallback="diagonal", curvature_samples=samples
    )
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        first = problem.loss_of(model, X, y, lossfunc).item()
    bd = problem.batch_dim  # 1 for the sequence-first encoder
    for _ in range(40):
        index = torch.randint(0, X.shape[bd], (16,), generator=generator)
        opt.zero_grad()
        batch = X.index_select(bd, index), y.index_select(bd, index)
        problem.loss_of(model, *batch, lossfunc).backward()
        opt.step()
    with torch.no_grad():
        last = problem.loss_of(model, X, y, lossfunc).item()
    assert last < 0.95 * first, (first, last)
