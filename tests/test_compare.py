"""``python -m experiments compare``: its math against ``curvopt.linalg`` and dense blocks,
and the command plus its figure end to end on tiny synthetic data."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

import curvopt
from curvopt import linalg
from experiments.__main__ import main as experiments_main
from experiments.compare import run as compare
from experiments.compare.metrics import (
    block_metrics,
    eigen_block,
    exact_blocks,
    kron_block,
    reference,
    select,
)
from experiments.problems import get_problem
from fixtures import zoo
from paper_figs.cli import main as figs_main

DT = torch.float64
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning"
)


def _tiny(reduction="mean"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).to(DT)
    x, y = torch.randn(6, 3, dtype=DT), torch.randint(0, 3, (6,))
    return model, nn.CrossEntropyLoss(reduction=reduction), x, y


def test_select_takes_small_parameters_whole_and_bounds_large_blocks():
    gen = torch.Generator().manual_seed(0)
    whole = select("b", (10,), 64, gen)
    assert whole.size == 10 and torch.equal(whole.flat, torch.arange(10))
    part = select("w", (30, 5, 3, 3), 100, gen)
    assert part.size <= 100 and len(part.rows) > 1 and len(part.cols) > 1
    assert len(set(part.flat.tolist())) == part.size and part.flat.max() < 30 * 45
    assert select("w", (30, 45), 0, gen).size == 30 * 45  # 0: everything


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_exact_blocks_are_the_linalg_ggn_and_empirical_fisher(reduction):
    model, plain_loss, x, y = _tiny(reduction)
    gen = torch.Generator().manual_seed(1)
    sels = [select(n, tuple(p.shape), 6, gen) for n, p in model.named_parameters()]
    blocks = exact_blocks(model, plain_loss, x, y, sels, mean=reduction == "mean", chunk=4)
    extended = curvopt.extend(model)
    lossfunc = curvopt.extend(nn.CrossEntropyLoss(reduction=reduction))
    data = [(x[:4], y[:4]), (x[4:], y[4:])]
    ggn = linalg.GGN(extended, lossfunc, data).to_dense()
    ef = linalg.EmpiricalFisher(extended, lossfunc, data).to_dense()
    lossfunc(extended(x), y).backward()
    gradient = torch.cat([p.grad.flatten() for p in extended.parameters()])
    offset = 0
    for sel, p in zip(sels, model.parameters()):
        idx = (offset + sel.flat).numpy()
        G, EF, g = blocks[sel.name]
        np.testing.assert_allclose(G.numpy(), ggn[np.ix_(idx, idx)], atol=1e-12)
        np.testing.assert_allclose(EF.numpy(), ef[np.ix_(idx, idx)], atol=1e-12)
        np.testing.assert_allclose(g.numpy(), gradient[idx].numpy(), atol=1e-12)
        offset += p.numel()


def test_kron_block_is_the_submatrix_of_the_kronecker_product():
    B, A = torch.randn(4, 4, dtype=DT), torch.randn(6, 6, dtype=DT)
    sel = select("w", (4, 2, 3), 6, torch.Generator().manual_seed(0))
    idx = sel.flat
    torch.testing.assert_close(kron_block([B, A], sel), torch.kron(B, A)[idx][:, idx])


def test_eigen_block_is_the_submatrix_of_the_eigen_corrected_curvature():
    gen = torch.Generator().manual_seed(0)
    q_b = torch.linalg.qr(torch.randn(4, 4, generator=gen, dtype=DT))[0]
    q_a = torch.linalg.qr(torch.randn(6, 6, generator=gen, dtype=DT))[0]
    s = torch.rand(4, 6, generator=gen, dtype=DT)
    q = torch.kron(q_b, q_a)
    dense = q @ torch.diag(s.flatten()) @ q.T
    sel = select("w", (4, 2, 3), 6, gen)
    idx = sel.flat
    assert 1 < len(sel.rows) < 4 and 1 < len(sel.cols) < 6
    torch.testing.assert_close(eigen_block([q_b, q_a], s, sel), dense[idx][:, idx])
    bias = select("b", (4,), 6, gen)
    expected = q_b @ torch.diag(s[:, 0]) @ q_b.T
    torch.testing.assert_close(eigen_block([q_b], s[:, :1], bias), expected)


def test_compare_puts_ekfac_beside_kfac_with_the_linalg_operator_blocks():
    """``ekfac`` is built with the other approximations, and on whole parameters its block is
    the diagonal block of ``linalg.EKFAC``'s dense matrix."""
    model, _, x, y = _tiny()
    extended = curvopt.extend(model)
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    data = [(x, y)]
    approx = compare._approximations(extended, lossfunc, data, seed=0)
    assert list(approx)[-1] == "ekfac" and "ekfac" in compare.APPROXIMATIONS
    op, error = approx["ekfac"]
    assert error is None and isinstance(op, linalg.EKFAC)
    dense = op.to_dense()
    offset = 0
    for p in extended.parameters():
        sel = select("p", tuple(p.shape), 0, torch.Generator())
        block = compare._block(op, p, sel)
        n = p.numel()
        np.testing.assert_allclose(block.numpy(), dense[offset : offset + n, offset : offset + n])
        offset += n


def test_block_metrics_of_the_exact_block_and_of_a_scaled_one():
    gen = torch.Generator().manual_seed(0)
    root = torch.randn(8, 8, generator=gen, dtype=DT)
    G, g = root @ root.T, torch.randn(8, generator=gen, dtype=DT)
    ref = reference(G, g, damping=0.0, k=3)
    same = block_metrics(ref, G)
    assert same["rel_frobenius"] == 0 and same["overlap"] == pytest.approx(1)
    assert same["cosine"] == pytest.approx(1) and same["decrease_ratio"] == pytest.approx(1)
    double = block_metrics(ref, 2 * G)
    assert double["rel_frobenius"] == pytest.approx(1) and double["overlap"] == pytest.approx(1)
    # d = -(2G)^-1 g earns 3/4 of the Newton decrease of the quadratic model
    assert double["decrease_ratio"] == pytest.approx(0.75)
    diagonal = block_metrics(ref, torch.diag(torch.diagonal(G)))
    assert 0 < diagonal["cosine"] < 1 and 0 < diagonal["overlap"] < 1


@pytest.mark.parametrize("problem", ["fmnist_2c2d", "gpt"])
def test_compare_command_and_figure_end_to_end(tmp_path, problem, capsys):
    args = ["compare", problem, "--train-size", "32", "--curvature-size", "8"]
    args += ["--batch-size", "8", "--checkpoints", "0", "1", "--max-block", "48"]
    args += ["--synthetic", "--no-progress", "--results-dir", str(tmp_path)]
    assert experiments_main(args) == 0
    path = tmp_path / "compare" / f"{problem}_synthetic.json"
    result = json.loads(path.read_text())
    assert result["synthetic"] and [c["epoch"] for c in result["checkpoints"]] == [0, 1]
    layers = result["checkpoints"][-1]["layers"]
    assert [layer["name"] for layer in layers] == [
        n for n, p in result_model_names(problem) if p.requires_grad
    ]
    for layer in layers:
        assert layer["block"][0] * layer["block"][1] <= 48
        ef = layer["approximations"]["empirical_fisher"]
        assert 0 <= ef["rel_frobenius"] and -1 <= ef["cosine"] <= 1
    if problem == "gpt":  # the tied embedding: the nearest Kronecker product of its two uses
        by_name = {layer["name"]: layer["approximations"] for layer in layers}
        assert by_name["tok.weight"]["kflr"]["rel_frobenius"] >= 0
        assert by_name["block.fc.weight"]["kflr"]["rel_frobenius"] >= 0
    undefined = layers[0]["approximations"]["kfra"]
    assert "error" in undefined and "Error" in undefined["error"]  # KFRA: no convs, no attention
    ekfac = layers[-1]["approximations"]["ekfac"]
    assert ekfac["rel_frobenius"] >= 0 and -1 <= ekfac["cosine"] <= 1
    assert "| kflr |" in capsys.readouterr().out
    assert figs_main(["compare", str(tmp_path), str(tmp_path / "figs")]) == 0
    png = tmp_path / "figs" / f"compare_{problem}_synthetic.png"
    assert png.read_bytes()[:8] == PNG_MAGIC


def result_model_names(problem):
    if problem == "gpt":
        return list(zoo.gpt(vocab=16, T=8).model.named_parameters())
    return list(get_problem(problem).model(0).named_parameters())
