"""Low-rank Kronecker factors: Gram roots from the engine, Woodbury inverses in the optimizer.

A factor ``F = UᵀU`` built from fewer rows than its size (a batch smaller than a layer's width)
carries its root ``U`` (``reductions.gram_root``); ``optim.KFAC`` then inverts ``F + c I`` by
Woodbury. Everything is checked in float64 against dense products and dense solves.
"""

import pytest
import torch
from torch import nn

import curvopt
import curvopt.engine.curvature
from curvopt import extensions as ext
from curvopt.optim import KFAC
from curvopt.inversion.trace_norm import (
    kron_cholesky_solve,
    kron_solve,
    trace_norm_cholesky,
    trace_norm_damped,
    trace_norm_pi,
    trace_norm_solvers,
)
from curvopt.core.reductions import gram, gram_add_, gram_root, nonzero_rows
from curvopt.inversion import factor_inverse
from curvopt.inversion.factor_inverse import LowRankInverse, root_alone, woodbury_cheaper

DT = torch.float64


def gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("rows, dim", [(3, 10), (10, 10), (40, 10), (600, 520), (100, 520)])
def test_gram_matches_matmul_and_root_reproduces_it(rows, dim):
    x = torch.randn(rows, dim, dtype=DT, generator=gen(rows + dim))
    product = gram(x, 0.3)
    torch.testing.assert_close(product, 0.3 * x.T @ x)
    torch.testing.assert_close(product, product.T)
    root = gram_root(product)
    if rows < dim:
        assert root.shape == (rows, dim)
        torch.testing.assert_close(root.T @ root, product)
    else:
        assert root is None


def test_nonzero_rows_drop_only_rows_that_add_nothing_to_the_gram():
    """Columns packed by slot are zero at most rows: those go (the Gram unchanged, and its
    root now shorter than the width); a mostly nonzero matrix and an all-zero one keep a root."""
    x = torch.randn(40, 20, dtype=DT, generator=gen(3))
    x[::3] = 0  # a third zero: not worth a copy
    assert nonzero_rows(x) is x
    x[1::3] = 0
    x[4, 7] = 1e-100  # a zeroed row but for one small entry: kept
    kept = nonzero_rows(x)
    assert kept.shape == (14, 20)
    torch.testing.assert_close(gram(kept), x.T @ x)
    torch.testing.assert_close(gram_root(gram(kept)).T @ gram_root(gram(kept)), x.T @ x)
    none = nonzero_rows(torch.zeros(6, 4, dtype=DT))
    assert none.shape == (1, 4) and not none.any()


def test_gram_add_stacks_roots_while_they_stay_low_rank():
    a, b, c = (torch.randn(3, 8, dtype=DT, generator=gen(i)) for i in range(3))
    total = gram(a)
    gram_add_(total, gram(b))
    torch.testing.assert_close(gram_root(total).T @ gram_root(total), a.T @ a + b.T @ b)
    gram_add_(total, gram(c))  # 9 rows for a size of 8: no longer low rank
    assert gram_root(total) is None
    torch.testing.assert_close(total, a.T @ a + b.T @ b + c.T @ c)
    dense = torch.eye(8, dtype=DT)
    gram_add_(dense, gram(a))  # a root on one side only is no root of the sum
    assert gram_root(dense) is None


def _low_rank_factors(out_rows, in_rows, out_dim=12, in_dim=30):
    v = torch.randn(out_rows, out_dim, dtype=DT, generator=gen(1))
    x = torch.randn(in_rows, in_dim, dtype=DT, generator=gen(2))
    return [gram(v), gram(x, 1 / in_rows)]


def _dense_trace_norm_solve(factors, damping, matrix):
    damped = trace_norm_damped(factors, damping)
    dense = torch.kron(*damped) if len(damped) == 2 else damped[0]
    return torch.linalg.solve(dense, matrix.flatten()).reshape(matrix.shape)


@pytest.mark.parametrize("out_rows, in_rows", [(3, 4), (30, 4), (3, 60)])
def test_woodbury_solve_matches_dense_solve(out_rows, in_rows):
    factors = _low_rank_factors(out_rows, in_rows)
    matrix = torch.randn(12, 30, dtype=DT, generator=gen(3))
    solvers = trace_norm_cholesky(factors, 0.05)
    low_rank = [isinstance(s, LowRankInverse) for s in solvers]
    assert low_rank == [out_rows < 4, in_rows < 10]  # where Woodbury is cheaper
    expected = _dense_trace_norm_solve(factors, 0.05, matrix)
    torch.testing.assert_close(kron_cholesky_solve(solvers, matrix), expected)
    dense = trace_norm_cholesky(factors, 0.05, low_rank=False)
    assert all(isinstance(s, torch.Tensor) for s in dense)
    torch.testing.assert_close(kron_cholesky_solve(dense, matrix), expected)


def test_woodbury_solve_of_a_single_factor():
    g = torch.randn(5, 40, dtype=DT, generator=gen(4))
    factors = [gram(g)]
    solvers = trace_norm_cholesky(factors, 0.3)
    assert isinstance(solvers[0], LowRankInverse)
    rhs = torch.randn(40, 1, dtype=DT, generator=gen(5))
    expected = torch.linalg.solve(g.T @ g + 0.3 * torch.eye(40, dtype=DT), rhs)
    torch.testing.assert_close(kron_cholesky_solve(solvers, rhs), expected)


def test_factor_changed_in_place_falls_back_to_cholesky():
    factors = _low_rank_factors(3, 4)
    factors[1].mul_(2.0)  # the root no longer reproduces the factor
    solvers = trace_norm_cholesky(factors, 0.05)
    assert not isinstance(solvers[1], LowRankInverse)
    matrix = torch.randn(12, 30, dtype=DT, generator=gen(6))
    torch.testing.assert_close(
        kron_cholesky_solve(solvers, matrix), _dense_trace_norm_solve(factors, 0.05, matrix)
    )


def test_zero_damping_keeps_the_dense_error():
    factors = _low_rank_factors(3, 4)
    with pytest.raises(torch.linalg.LinAlgError, match="damping"):
        trace_norm_cholesky(factors, 0.0)


def _mlp(batch, seed=0):
    torch.manual_seed(seed)
    model = curvopt.extend(nn.Sequential(nn.Linear(30, 40), nn.Tanh(), nn.Linear(40, 12)).to(DT))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    x = torch.randn(batch, 30, dtype=DT, generator=gen(seed + 10))
    y = torch.randint(0, 12, (batch,), generator=gen(seed + 11))
    return model, lossfunc, x, y


@pytest.mark.parametrize("budget", [None, 100])
@pytest.mark.parametrize("quantity", [ext.KFLR, ext.KFAC])
def test_engine_factors_carry_roots_that_reproduce_them(quantity, budget, monkeypatch):
    """Also when the columns come in several chunks (the output factor adds them up)."""
    if budget is not None:
        monkeypatch.setattr(curvopt.engine.curvature, "_COLUMN_BUDGET", budget)
    model, lossfunc, x, y = _mlp(batch=3)
    with curvopt.collect(quantity()):
        lossfunc(model(x), y).backward()
    attr = quantity().attr
    columns = 12 if attr == "kflr" else 1  # per sample: one per class, or one sampled
    for p in model.parameters():
        for index, factor in enumerate(getattr(p, attr)):
            rows = x.shape[0] * (columns if index == 0 else 1)  # output side, input side
            root = gram_root(factor)
            assert (root is not None) == (rows < factor.shape[0])
            if root is not None:
                torch.testing.assert_close(root.T @ root, factor)


@pytest.mark.parametrize("curvature", ["kflr", "kfac"])
def test_kfac_step_with_woodbury_matches_dense_solve(curvature):
    model, lossfunc, x, y = _mlp(batch=4)
    lam = 0.03
    opt = KFAC(model.parameters(), lr=0.5, damping=lam, curvature=curvature, kl_clip=None)
    torch.manual_seed(7)
    opt.zero_grad()
    with opt.collect():
        lossfunc(model(x), y).backward()
    before = [p.detach().clone() for p in model.parameters()]
    expected = []
    for p, old in zip(model.parameters(), before):
        factors = getattr(p, curvature)
        matrix = p.grad.reshape(factors[0].shape[0], -1)
        step = _dense_trace_norm_solve(factors, lam, matrix).reshape(p.shape)
        expected.append(old - 0.5 * step)
    opt.step()
    kinds = [type(s) for p in model.parameters() for s in opt.state[p]["cholesky"]["value"]]
    assert LowRankInverse in kinds
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.detach(), e)


@pytest.mark.parametrize("beta", [0.5, 0.9])
def test_curvature_ema_keeps_the_woodbury_form_while_the_stacked_roots_stay_low_rank(beta):
    """``β F̄ + (1 − β) F`` of low-rank factors is the Gram of ``[√β Ū; √(1−β) U]``: the step is
    the dense solve with the averaged factors (float64), by Woodbury while the stacked roots have
    fewer rows than the factor (batches of 4 for the 30-wide input: 7 steps) and that is cheaper,
    by Cholesky after."""
    model, lossfunc, _, _ = _mlp(batch=4)
    lam, lr = 0.03, 0.5
    opt = KFAC(
        model.parameters(), lr=lr, damping=lam, curvature="kflr", curvature_ema=beta, kl_clip=None
    )
    first = model[0].weight
    averages = {}
    for step in range(9):
        x = torch.randn(4, 30, dtype=DT, generator=gen(20 + step))
        y = torch.randint(0, 12, (4,), generator=gen(40 + step))
        opt.zero_grad()
        with opt.collect():
            lossfunc(model(x), y).backward()
        before = [p.detach().clone() for p in model.parameters()]
        expected = []
        for p, old in zip(model.parameters(), before):
            new = [f.clone() for f in p.kflr]
            last = averages.get(p)
            averages[p] = (
                new if last is None else [beta * a + (1 - beta) * n for a, n in zip(last, new)]
            )
            matrix = p.grad.reshape(new[0].shape[0], -1)
            step_ = _dense_trace_norm_solve(averages[p], lam, matrix).reshape(p.shape)
            expected.append(old - lr * step_)
        opt.step()
        for p, e in zip(model.parameters(), expected):
            torch.testing.assert_close(p.detach(), e)
        rows, dim, others = 4 * (step + 1), 30, 40  # the input factor of the first layer
        root = gram_root(opt.state[first]["curvature"][1])
        assert (root is not None) == (rows < dim)
        # rank = rows here; the r x r eigendecomposition counted as 20 r^3 (EIGH_COST)
        woodbury_flops = 4 * dim * rows**2 + 20 * rows**3 + 4 * others * dim * rows
        cheaper = woodbury_flops < dim**3 + 2 * others * dim**2
        woodbury = isinstance(opt.state[first]["cholesky"]["value"][1], LowRankInverse)
        assert woodbury == (rows < dim and cheaper), step
    assert not woodbury


def test_woodbury_in_float32_is_as_accurate_as_float64_allows():
    """Small damping, widths well above the batch: float32 Woodbury stays within 1e-5 of the
    float64 dense solve (float32 Cholesky of the dense damped factors loses about 1e-3 here)."""
    x = torch.randn(32, 400, generator=gen(8)).relu()
    v = 0.01 * torch.randn(32, 200, generator=gen(9))
    matrix = 1e-3 * torch.randn(200, 400, generator=gen(10))
    lam = 1e-4
    exact = trace_norm_cholesky([gram(v.to(DT)), gram(x.to(DT), 1 / 32)], lam, low_rank=False)
    reference = kron_cholesky_solve(exact, matrix.to(DT))
    solvers = trace_norm_cholesky([gram(v), gram(x, 1 / 32)], lam)
    assert all(isinstance(s, LowRankInverse) for s in solvers)
    result = kron_cholesky_solve(solvers, matrix).to(DT)
    assert float((result - reference).norm() / reference.norm()) < 1e-5


def _rooted(rows: torch.Tensor) -> torch.Tensor:
    """``rowsᵀ rows`` carrying ``rows`` as its Gram root (whatever their number)."""
    product = rows.T @ rows
    product.gram_root = rows
    return product


def _reference(factors, damping, matrix):
    """``(B + √λ/π I)⁻¹ G (A + π√λ I)⁻¹``, ``π = sqrt((tr A/dim A)/(tr B/dim B))`` (the API's
    split, written out here), by dense float64 solves."""
    b, a = factors
    pi = ((a.trace() / a.shape[0]) / (b.trace() / b.shape[0])).sqrt()
    b = b + damping**0.5 / pi * torch.eye(b.shape[0], dtype=b.dtype)
    a = a + pi * damping**0.5 * torch.eye(a.shape[0], dtype=a.dtype)
    return torch.linalg.solve(a, torch.linalg.solve(b, matrix).T).T


def _stacked_ema_factors():
    """``[B, A]`` as a curvature EMA of three passes over one batch (β = 0.9) stacks them:
    ``A``'s root has 3 x 5 rows of rank 5 for a size of 40, ``B``'s 3 x 2 rows of rank 6 for
    12; ``A`` is ~900x larger than ``B`` (π ≈ 30)."""
    x = 30 * torch.randn(5, 40, dtype=DT, generator=gen(50))
    v = [torch.randn(2, 12, dtype=DT, generator=gen(51 + i)) for i in range(3)]
    weights = [0.9**2, 0.9 * 0.1, 0.1]  # β², β(1−β), (1−β) for passes 1, 2, 3
    a_root = torch.cat([w**0.5 * x for w in weights])
    b_root = torch.cat([w**0.5 * vi for w, vi in zip(weights, v)])
    return [_rooted(b_root), _rooted(a_root)]


@pytest.mark.usefixtures("woodbury_at_any_size")
@pytest.mark.parametrize("solve", ["matmul", "cholesky"])
def test_woodbury_of_stacked_rank_deficient_roots_is_exact_and_compressed(solve):
    """Both forms (dense inverses and matrix products, Cholesky factors and triangular solves)
    against the dense reference, with π far from 1 and ``A``'s stacked root of rank 5 < 15
    rows: its Woodbury basis keeps the 5 directions, ``B``'s all 6."""
    factors = _stacked_ema_factors()
    assert float(trace_norm_pi(factors)) > 20
    matrix = torch.randn(12, 40, dtype=DT, generator=gen(60))
    build, apply = {
        "matmul": (trace_norm_solvers, kron_solve),
        "cholesky": (trace_norm_cholesky, kron_cholesky_solve),
    }[solve]
    solvers = build(factors, 0.3)
    assert [type(s) for s in solvers] == [torch.Tensor, LowRankInverse]  # B: 6 rows of 12
    assert solvers[1].rank == 5
    torch.testing.assert_close(apply(solvers, matrix), _reference(factors, 0.3, matrix))
    woodbury_b = LowRankInverse.of(gram_root(factors[0]), 0.7)
    assert woodbury_b.rank == 6
    expected = torch.linalg.solve(factors[0] + 0.7 * torch.eye(12, dtype=DT), matrix)
    torch.testing.assert_close(woodbury_b.solve_left(matrix), expected)


def test_dense_inverses_match_the_reference_with_pi_far_from_one():
    """Full-rank factors (no roots): the cached inverses applied by products are the solve."""
    x = 30 * torch.randn(50, 20, dtype=DT, generator=gen(61))
    v = torch.randn(30, 7, dtype=DT, generator=gen(62))
    factors = [v.T @ v, x.T @ x]
    matrix = torch.randn(7, 20, dtype=DT, generator=gen(63))
    solvers = trace_norm_solvers(factors, 0.05)
    torch.testing.assert_close(kron_solve(solvers, matrix), _reference(factors, 0.05, matrix))
    bias = torch.randn(7, 1, dtype=DT, generator=gen(64))
    expected = torch.linalg.solve(factors[0] + 0.05 * torch.eye(7, dtype=DT), bias)
    torch.testing.assert_close(kron_solve(trace_norm_solvers(factors[:1], 0.05), bias), expected)


def test_rank_cap_inverts_the_best_rank_k_approximation():
    """``max_rank=k`` is an approximation: ``(F_k + c I)⁻¹`` with ``F_k`` the top-``k``
    eigenpart of ``F``, visibly different from the exact inverse; the default is exact."""
    root = torch.randn(8, 30, dtype=DT, generator=gen(65)) * torch.linspace(3, 0.1, 8)[:, None].to(
        DT
    )
    factor, shift = root.T @ root, 0.05
    matrix = torch.randn(30, 6, dtype=DT, generator=gen(66))
    values, vectors = torch.linalg.eigh(factor)
    top = vectors[:, -3:] @ torch.diag(values[-3:]) @ vectors[:, -3:].T
    eye = torch.eye(30, dtype=DT)
    capped = LowRankInverse.of(root, shift, max_rank=3)
    assert capped.rank == 3
    torch.testing.assert_close(
        capped.solve_left(matrix), torch.linalg.solve(top + shift * eye, matrix)
    )
    exact = torch.linalg.solve(factor + shift * eye, matrix)
    assert float((capped.solve_left(matrix) - exact).norm() / exact.norm()) > 0.1
    torch.testing.assert_close(LowRankInverse.of(root, shift).solve_left(matrix), exact)
    torch.testing.assert_close(LowRankInverse.of(root, shift).solve_right(matrix.T), exact.T)
    # the cap reaches the optimizer's form through trace_norm_solvers
    factors = [_rooted(root[:2, :5]), _rooted(root)]
    solvers = trace_norm_solvers(factors, 0.3, max_rank=3)
    assert solvers[1].rank == 3 and trace_norm_solvers(factors, 0.3)[1].rank == 8


def test_float32_woodbury_with_a_shift_below_the_rounding_of_the_gram_recomputes_in_float64():
    """``c = 1e-6 · s_max``: the float32 ``U Uᵀ`` rounds its eigenvalues by ~1e-7 · s_max, of
    the order of ``c``; the basis is recomputed in float64 and stays float32, within 1e-4 of the
    float64 solve (relative, in the norm of ``(F + c I)⁻¹``'s result)."""
    root64 = (
        torch.randn(16, 200, dtype=DT, generator=gen(67))
        * torch.logspace(0, -4, 16, dtype=DT)[:, None]
    )
    shift = 1e-6 * float(torch.linalg.eigvalsh(root64 @ root64.T)[-1])
    matrix64 = torch.randn(200, 3, dtype=DT, generator=gen(68))
    expected = torch.linalg.solve(root64.T @ root64 + shift * torch.eye(200, dtype=DT), matrix64)
    solver = LowRankInverse.of(root64.float(), shift)
    assert solver.basis.dtype == torch.float32
    result = solver.solve_left(matrix64.float()).double()
    assert float((result - expected).norm() / expected.norm()) < 1e-4


@pytest.mark.usefixtures("woodbury_at_any_size")
def test_curvature_ema_over_one_batch_keeps_woodbury_at_the_batch_rank():
    """Training on one repeated batch of 4 (kflr, β = 0.9): ``A`` of the first layer (30 wide)
    is an average of identical Grams, its stacked root grows by 4 rows per step while the
    Woodbury basis stays at rank 4; every step is the dense float64 solve with the averaged
    factors."""
    model, lossfunc, x, y = _mlp(batch=4)
    lam, lr, beta = 0.03, 0.5, 0.9
    opt = KFAC(
        model.parameters(), lr=lr, damping=lam, curvature="kflr", curvature_ema=beta, kl_clip=None
    )
    first = model[0].weight
    averages = {}
    for step in range(5):
        opt.zero_grad()
        with opt.collect():
            lossfunc(model(x), y).backward()
        expected = []
        for p in model.parameters():
            new = [f.clone() for f in p.kflr]
            last = averages.get(p)
            averages[p] = (
                new if last is None else [beta * a + (1 - beta) * n for a, n in zip(last, new)]
            )
            matrix = p.grad.reshape(new[0].shape[0], -1)
            if len(new) == 2:
                step_ = _reference(averages[p], lam, matrix)
            else:
                step_ = torch.linalg.solve(
                    averages[p][0] + lam * torch.eye(len(matrix), dtype=DT), matrix
                )
            expected.append(p.detach() - lr * step_.reshape(p.shape))
        opt.step()
        for p, e in zip(model.parameters(), expected):
            torch.testing.assert_close(p.detach(), e)
        assert gram_root(opt.state[first]["curvature"][1]).shape[0] == 4 * (step + 1)
        woodbury = opt.state[first]["cholesky"]["value"][1]
        assert isinstance(woodbury, LowRankInverse) and woodbury.rank == 4


def test_the_woodbury_cost_model_counts_the_r_by_r_eigendecomposition():
    """``4 d r² + 20 r³`` (the Gram of the root, ``V``, and the eigendecomposition counted as
    ``EIGH_COST = 20`` times ``r³``) plus the application, against ``d³`` (``20 d³`` where the
    dense form is an eigendecomposition too) plus the dense application; the numbers are 2C2D's
    fc1 (``A`` 3136 wide, ``B`` 1024)."""
    assert factor_inverse.EIGH_COST == 20
    assert woodbury_cheaper(3136, 512, 512, 1024)
    # 4 d r² + 4 m d k = 30.8 + 20.1 G flops against 30.8 + 20.1 G: Woodbury without the eigh
    # term; its 1,568² eigendecomposition (77 G) makes the dense inverse the cheaper one
    assert not woodbury_cheaper(3136, 1568, 1568, 1024)
    assert woodbury_cheaper(100, 40, 40, 1, dense_eigh=True)  # 20 d³ on the dense side
    assert not woodbury_cheaper(100, 40, 40, 1)  # 4 d r² + 20 r³ = 1.9 M > d³ = 1 M
    # the root alone: at most d / 2 rows and 4 d r² + 20 r³ < d³
    assert root_alone(979, 3136) and not root_alone(980, 3136)
    assert root_alone(319, 1024) and not root_alone(320, 1024)
    assert root_alone(9, 30) and not root_alone(10, 30) and not root_alone(16, 30)
    assert not root_alone(17, 33)  # over half the size, whatever the flops
