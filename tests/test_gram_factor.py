"""Curvature averages kept as their Gram roots (``reductions.GramFactor``).

The EMA of Kronecker factors that carry Gram roots is the Gram of the stacked, weighted roots;
while the stack has at most half as many rows as the factor's size the optimizer keeps only the
rows. Everything here is in float64 against the dense average: the EMA itself, and whole KFAC
runs with every inverse form that reads the average (Cholesky, dense inverses, eigenbases, the
exact damping, a rank cap, adaptive damping's quadratic model), which must take the same steps
as with the dense average (the root-only form switched off).
"""

import io

import pytest
import torch
from torch import nn

import curvopt
import curvopt.optim.transforms
from curvopt.core.reductions import GramFactor, dense, diagonal, gram, gram_root
from curvopt.optim import KFAC, LevenbergMarquardt
from curvopt.optim.transforms import ema

DT = torch.float64


def gen(seed):
    return torch.Generator().manual_seed(seed)


def _rooted(rows: int, dim: int, seed: int) -> torch.Tensor:
    return gram(torch.randn(rows, dim, dtype=DT, generator=gen(seed)))


def test_gram_factor_reads_like_its_dense_matrix():
    root = torch.randn(3, 8, dtype=DT, generator=gen(0))
    factor = GramFactor(root)
    assert factor.shape == (8, 8) and factor.dtype == DT and gram_root(factor) is root
    torch.testing.assert_close(dense(factor), root.T @ root)
    assert torch.equal(gram_root(dense(factor)), root)
    torch.testing.assert_close(diagonal(factor), torch.diagonal(root.T @ root))
    assert factor.to(torch.float32).root.dtype == torch.float32


@pytest.mark.parametrize("decay", [0.5, 0.95])
def test_ema_keeps_the_root_alone_while_woodbury_is_cheaper_then_dense(decay):
    """Rows 4, 8, ..., 40 for a size of 30: the root alone while Woodbury is the cheaper inverse
    whatever the other side (at most 15 rows and ``4 d r² + 20 r³ < d³``: 4 and 8 rows), the
    dense average carrying its root up to 29, the dense average without a root from 30; always
    the dense float64 average."""
    averages, reference = None, None
    for step in range(10):
        new = _rooted(4, 30, step)
        averages = ema(averages, [new], decay)
        average = averages[0]
        reference = new if reference is None else decay * reference + (1 - decay) * new
        rows = 4 * (step + 1)
        torch.testing.assert_close(dense(average), reference)
        alone = rows <= 15 and 4 * 30 * rows**2 + 20 * rows**3 < 30**3
        assert isinstance(average, GramFactor) == (1 < step + 1 and alone), step
        root = gram_root(average)
        assert (root is not None) == (rows < 30)
        if root is not None:
            torch.testing.assert_close(root.T @ root, reference)


def test_ema_of_a_root_and_a_dense_factor_is_dense():
    average = ema(None, [_rooted(2, 20, 1)], 0.9)
    average = ema(average, [_rooted(2, 20, 2)], 0.9)
    assert isinstance(average[0], GramFactor)
    full = _rooted(25, 20, 3)  # as many rows as the size: no root
    assert gram_root(full) is None
    mixed = ema(average, [full], 0.9)[0]
    assert isinstance(mixed, torch.Tensor) and gram_root(mixed) is None
    torch.testing.assert_close(mixed, 0.9 * dense(average[0]) + 0.1 * full)


def _mlp(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(30, 40), nn.Tanh(), nn.Linear(40, 12)).to(DT)
    return curvopt.extend(model), curvopt.extend(nn.CrossEntropyLoss())


def _batches(count, batch=3):
    return [
        (
            torch.randn(batch, 30, dtype=DT, generator=gen(100 + i)),
            torch.randint(0, 12, (batch,), generator=gen(200 + i)),
        )
        for i in range(count)
    ]


OPTIONS = {
    "cholesky": {},
    "inverse": {"inverse_interval": 2},
    "trace_norm_eigh": {"kronecker_damping": "trace_norm_eigh"},
    "exact": {"kronecker_damping": "exact"},
    "max_rank": {"max_rank": 4},
    "adaptive": {"damping": LevenbergMarquardt(0.05, interval=1)},
    "kl_clip_momentum": {"kl_clip": 1e-2, "momentum": 0.9},
}


def _train(options, root_only, monkeypatch, steps=6):
    """Parameters and the first layer's averaged input factor after ``steps`` KFAC steps (KFLR,
    β = 0.8, batches of 3: the 30-wide input factor's average has 3, 6, ... rows)."""
    if not root_only:
        monkeypatch.setattr(curvopt.optim.transforms, "root_alone", lambda rows, dim: False)
    model, lossfunc = _mlp()
    kwargs = {"lr": 0.3, "damping": 0.05, "curvature": "kflr", "curvature_ema": 0.8}
    kwargs["kl_clip"] = None
    kwargs.update(options)
    opt = KFAC(model.parameters(), **kwargs)
    factors = []
    for x, y in _batches(steps):

        def closure(x=x, y=y):
            opt.zero_grad()
            loss = lossfunc(model(x), y)
            loss.backward()
            return loss

        opt.step(closure)
        factors.append(opt.state[model[0].weight]["curvature"][1])
    monkeypatch.undo()
    return [p.detach().clone() for p in model.parameters()], factors


@pytest.mark.parametrize("name", list(OPTIONS))
def test_kfac_steps_with_root_averages_equal_those_with_dense_averages(name, monkeypatch):
    params, factors = _train(OPTIONS[name], True, monkeypatch)
    reference, dense_factors = _train(OPTIONS[name], False, monkeypatch)
    kinds = [type(f) for f in factors]
    assert GramFactor in kinds and torch.Tensor in kinds  # both forms were stepped with
    assert all(type(f) is torch.Tensor for f in dense_factors)
    for f, d in zip(factors, dense_factors):
        torch.testing.assert_close(dense(f), d, rtol=1e-10, atol=1e-12)
    for p, r in zip(params, reference):
        torch.testing.assert_close(p, r, rtol=1e-9, atol=1e-11)


def test_state_with_root_averages_saves_and_resumes_exactly(monkeypatch):
    """``state_dict`` through ``torch.save`` / ``torch.load(weights_only=True)`` in the middle of
    the root-only phase: the resumed run takes the same steps."""
    batches = _batches(6)
    model, lossfunc = _mlp()
    opt = KFAC(model.parameters(), lr=0.3, damping=0.05, curvature="kflr", curvature_ema=0.8)

    def step(model, opt, x, y):
        opt.zero_grad()
        lossfunc(model(x), y).backward()
        opt.step()

    for x, y in batches[:3]:
        step(model, opt, x, y)
    assert isinstance(opt.state[model[0].weight]["curvature"][1], GramFactor)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed_model, _ = _mlp(seed=1)
    resumed_model.load_state_dict(saved["model"])
    resumed = KFAC(
        resumed_model.parameters(), lr=0.3, damping=0.05, curvature="kflr", curvature_ema=0.8
    )
    resumed.load_state_dict(saved["opt"])
    for x, y in batches[3:]:
        step(model, opt, x, y)
        step(resumed_model, resumed, x, y)
    for p, q in zip(model.parameters(), resumed_model.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0)


def test_a_wide_layer_keeps_no_dense_average():
    """A 600-wide input at batch 8 (β = 0.95, whole-batch KFAC): after 20 steps the averaged
    input factor is 160 rows of 600, not a 600 x 600 matrix."""
    torch.manual_seed(0)
    model = curvopt.extend(nn.Sequential(nn.Linear(600, 16), nn.ReLU(), nn.Linear(16, 4)))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    opt = KFAC(model.parameters(), lr=0.1, damping=0.1, curvature_ema=0.95)
    for _ in range(20):
        opt.zero_grad()
        lossfunc(model(torch.randn(8, 600)), torch.randint(0, 4, (8,))).backward()
        opt.step()
    average = opt.state[model[0].weight]["curvature"][1]
    assert isinstance(average, GramFactor) and average.root.shape == (160, 600)
    assert all(torch.isfinite(p).all() for p in model.parameters())
