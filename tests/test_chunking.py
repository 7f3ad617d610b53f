"""Results do not depend on the memory budgets that split work into chunks of samples/columns."""

import pytest
import torch
from reference import hessian
from torch import nn

import curvopt.engine.curvature
import curvopt.engine.diagonals
import curvopt.engine.reducer
from curvopt.graph import propagate
from curvopt import extensions as ext
from curvopt.layers.conv import ConvRule
from curvopt.layers.linear import LinearRule
from tests.conftest import (
    assert_close,
    extended_copy,
    ggn_reference,
    per_sample_grads_loop,
    run_second_order,
)

DT = torch.float64


def _cnn():
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.Tanh(),
        nn.Conv2d(3, 2, 2, stride=2),
        nn.Flatten(),
        nn.Linear(2 * 3 * 3, 4),
        nn.Sigmoid(),
        nn.Linear(4, 3),
    ).to(DT)


@pytest.mark.parametrize("budget", [1, 50, 10**9])
def test_second_order_budget(monkeypatch, budget, seed):
    monkeypatch.setattr(curvopt.engine.diagonals, "_GRAD_BUDGET", budget)
    monkeypatch.setattr(curvopt.engine.curvature, "_COLUMN_BUDGET", max(budget, 1))
    plain = _cnn()
    x, y = torch.randn(5, 2, 6, 6, dtype=DT), torch.randint(0, 3, (5,))
    lossfunc = nn.CrossEntropyLoss()
    _, per_sample = ggn_reference(plain, lossfunc, x, y)
    model = extended_copy(plain)
    run_second_order(
        model,
        curvopt.extend(nn.CrossEntropyLoss()),
        x,
        y,
        ext.DiagGGNExact(),
        ext.BatchDiagGGNExact(),
    )
    for name, p in model.named_parameters():
        assert_close(p.diag_ggn_exact_batch, per_sample[name], name)
        assert_close(p.diag_ggn_exact, per_sample[name].sum(0), name)


@pytest.mark.parametrize("budget", [1, 100, 1 << 21])
def test_first_order_chunks(monkeypatch, budget, seed):
    monkeypatch.setattr(curvopt.engine.reducer, "_CHUNK_ELEMENTS", budget)
    plain = _cnn()
    x, y = torch.randn(5, 2, 6, 6, dtype=DT), torch.randint(0, 3, (5,))
    lossfunc = nn.CrossEntropyLoss(reduction="sum")
    reference = per_sample_grads_loop(plain, lossfunc, x, y)
    model = extended_copy(plain)
    with curvopt.collect(ext.SumGradSquared(), ext.Variance(), ext.BatchL2Grad()):
        lossfunc(model(x), y).backward()
    for name, p in model.named_parameters():
        g = reference[name]
        assert_close(p.sum_grad_squared, (g**2).sum(0), name)
        assert_close(p.variance, (g**2).mean(0) - g.mean(0) ** 2, name)
        assert_close(p.batch_l2, (g**2).flatten(1).sum(1), name)


def _pooled_cnn():
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.Tanh(),
        nn.MaxPool2d(3, stride=2, padding=1),
        nn.Conv2d(3, 2, 2),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(2 * 2 * 2, 4),
    ).to(DT)


def _exact_cells(model, x, y, lossfunc):
    """``{(name, attr): value}`` of every exact cell (DiagGGNExact, its per-sample terms,
    KFLR, DiagHessian) in one pass each."""
    values = {}
    cells = [
        (ext.DiagGGNExact(), ext.BatchDiagGGNExact()),
        (ext.KFLR(),),
        (ext.DiagHessian(), ext.BatchDiagHessian()),
    ]
    for exts in cells:
        run_second_order(model, lossfunc, x, y, *exts)
        for name, p in model.named_parameters():
            for e in exts:
                value = getattr(p, e.attr)
                values[name, e.attr] = value if isinstance(value, torch.Tensor) else list(value)
    return values


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_exact_cells_do_not_depend_on_the_column_budget(monkeypatch, reduction):
    """The memory budget only splits the propagated columns into chunks: the exact cells are
    the same from one column per chunk to all at once, and equal the torch.func references."""
    torch.manual_seed(0)
    plain = _pooled_cnn()
    x, y = torch.randn(5, 2, 6, 6, dtype=DT), torch.randint(0, 4, (5,))
    lossfunc = nn.CrossEntropyLoss(reduction=reduction)
    _, per_sample = ggn_reference(plain, lossfunc, x, y)
    hessian_diag, _ = hessian(plain, lossfunc, x, y)
    results = {}
    for budget in [1, 3 * 4 * 100, 1 << 30]:
        monkeypatch.setattr(curvopt.engine.curvature, "_COLUMN_BUDGET", budget)
        model = extended_copy(plain)
        results[budget] = _exact_cells(model, x, y, curvopt.extend(lossfunc))
    reference = results[1 << 30]
    for name in dict(plain.named_parameters()):
        assert_close(reference[name, "diag_ggn_exact_batch"], per_sample[name], name)
        assert_close(reference[name, "diag_ggn_exact"], per_sample[name].sum(0), name)
        assert_close(reference[name, "diag_h"], hessian_diag[name], name)
    for budget, values in results.items():
        for key, value in values.items():
            expected = reference[key]
            if isinstance(value, list):
                for v, e in zip(value, expected):
                    assert_close(v, e, f"{key} budget {budget}")
            else:
                assert_close(value, expected, f"{key} budget {budget}")


def test_propagated_columns_stay_within_the_budget(monkeypatch):
    """With a budget of two columns at every module output, no propagation from the loss
    carries more (the first pass's row probes go one at a time)."""
    torch.manual_seed(0)
    plain = _pooled_cnn()
    x, y = torch.randn(5, 2, 6, 6, dtype=DT), torch.randint(0, 4, (5,))
    lossfunc = nn.CrossEntropyLoss()
    per_column = 5 * (4 + 4 + 2 * 2 * 2 + 3 * 6 * 6)  # the loss input, Linear, Conv2d outputs
    monkeypatch.setattr(curvopt.engine.curvature, "_COLUMN_BUDGET", 2 * per_column)
    seen = []
    plain_backpropagate = propagate.backpropagate

    def counting(outputs, edges, columns, batched, walk):
        seen.append(columns.shape[0])
        return plain_backpropagate(outputs, edges, columns, batched, walk)

    monkeypatch.setattr(propagate, "backpropagate", counting)
    _, per_sample = ggn_reference(plain, lossfunc, x, y)
    model = extended_copy(plain)
    run_second_order(model, curvopt.extend(lossfunc), x, y, ext.DiagGGNExact())
    assert seen == [1, 1, 1, 1, 2, 2]  # 4 row probes one at a time, the loss's 4 columns two
    for name, p in model.named_parameters():
        assert_close(p.diag_ggn_exact, per_sample[name].sum(0), name)



def _counting(monkeypatch, rule, method, seen):
    """Patch ``rule.method`` to note the module of every call it gets in ``seen``."""
    plain = getattr(rule, method)

    def counting(self, call, *args):
        seen.append(call.module)
        return plain(self, call, *args)

    monkeypatch.setattr(rule, method, counting)


@pytest.mark.parametrize("samples", [None, 3])
def test_input_side_factors_once_per_pass_whatever_the_chunks(monkeypatch, samples, seed):
    """Each call's input-side Kronecker factor does not depend on the columns: it is computed
    once per pass, from all columns in one chunk to one column per chunk (its output side once
    per chunk), and the factors are the same with every budget (also from a sub-batch)."""
    plain = _cnn()
    x, y = torch.randn(5, 2, 6, 6, dtype=DT), torch.randint(0, 3, (5,))
    quantity = ext.KFLR() if samples is None else ext.KFLR(samples=samples)
    results = {}
    for budget in [1, 10**9]:
        monkeypatch.setattr(curvopt.engine.curvature, "_COLUMN_BUDGET", budget)
        inputs, outputs = [], []
        for rule in (ConvRule, LinearRule):
            _counting(monkeypatch, rule, "kron_input_factor", inputs)
            _counting(monkeypatch, rule, "kron_output_factor", outputs)
        model = extended_copy(plain)
        run_second_order(model, curvopt.extend(nn.CrossEntropyLoss()), x, y, quantity)
        monkeypatch.undo()
        weights = [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
        assert sorted(map(id, inputs)) == sorted(map(id, weights)), budget  # once each
        chunks = len(outputs) / (2 * len(weights))  # weight and bias
        assert chunks == (3 if budget == 1 else 1), budget  # CrossEntropy: 3 classes
        results[budget] = {k: list(p.kflr) for k, p in model.named_parameters()}
    for key, factors in results[1].items():
        assert len(factors) == len(results[10**9][key])
        for f, e in zip(factors, results[10**9][key]):
            assert_close(f, e, key)
