"""Floors of the overhead benchmark (``experiments.overhead.floors``): the flop and byte counts
against values computed by hand on tiny networks (non-square layers, a strided conv, a causal
decoder whose lower layers mix positions), the table's columns and the ``--floors`` option."""

import json

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from experiments.overhead import cli, floors
from experiments.overhead.cases import BACKPACK_CASES, CURVLINOPS_CASES, PLAIN
from experiments.overhead.problems import PROBLEMS, Problem, _images, _next_tokens, gpt
from experiments.overhead.report import markdown_table
from experiments.overhead.timing import Result

N, C = 2, 4  # samples, classes


def mlp_problem():
    """Linear(5, 3), ReLU, Linear(3, 4): I ≠ O in both layers."""
    build = lambda: nn.Sequential(nn.Linear(5, 3), nn.ReLU(), nn.Linear(3, 4))
    return Problem("mlp53", "", build, _images((5,), C), N)


def conv_problem():
    """Conv2d(2, 3, 3, stride 2, padding 1) on 2x5x5 (output 3x3x3: P = 9, I = 18), then
    Linear(27, 4)."""
    conv = lambda: nn.Conv2d(2, 3, 3, stride=2, padding=1)
    build = lambda: nn.Sequential(conv(), nn.Flatten(), nn.Linear(27, C))
    return Problem("conv", "", build, _images((2, 5, 5), C), N)


def flops(problem, quantity):
    return floors.floor(problem, quantity).flops


def test_structure_of_a_strided_conv_and_a_chain():
    conv, linear = floors.structure(conv_problem()).layers
    assert (conv.inputs, conv.outputs, conv.positions, conv.numel) == (18, 3, 9, 57)
    assert conv.conv and not conv.data_backward
    assert (linear.inputs, linear.outputs, linear.positions) == (27, 4, 1)
    assert linear.data_backward


def test_first_order_floors_on_non_square_layers():
    p = mlp_problem()  # numel 15 + 3 + 12 + 4 = 34
    assert floors.floor(p, "BatchGrad") == floors.Floor("mlp53", "BatchGrad", 0.0, 4 * N * 34)
    # ghost norms 2N(I+O) + N per weight, 2NO per bias
    assert flops(p, "BatchL2Grad") == (2 * 2 * 8 + 2) + 2 * 2 * 3 + (2 * 2 * 7 + 2) + 2 * 2 * 4
    assert floors.floor(p, "BatchL2Grad").bytes == 4 * N * 4
    assert flops(p, "SumGradSquared") == 2 * N * 34
    assert flops(p, "Variance") == 2 * N * 34 + 3 * 34


def test_curvature_floors_on_non_square_layers():
    p = mlp_problem()
    K = C - 1
    sqrt = 2 * N * C * K
    # first layer: no data backward; diagonal 2·N·O·I + 2·N·K·O + N·I, bias 2·N·K·O
    first = (2 * 2 * 3 * 5 + 2 * 2 * K * 3 + 2 * 5) + 2 * 2 * K * 3
    second = 2 * 2 * K * 4 * 3 + (2 * 2 * 4 * 3 + 2 * 2 * K * 4 + 2 * 3) + 2 * 2 * K * 4
    assert flops(p, "DiagGGNExact") == first + second + sqrt
    assert flops(p, "DiagHessian") == first + second + sqrt
    mc_first = (2 * 2 * 3 * 5 + 2 * 2 * 3 + 2 * 5) + 2 * 2 * 3
    mc_second = 2 * 2 * 4 * 3 + (2 * 2 * 4 * 3 + 2 * 2 * 4 + 2 * 3) + 2 * 2 * 4
    assert flops(p, "DiagGGNMC") == mc_first + mc_second
    # B = N·K·O², A = N·I²; the second layer backpropagates K columns
    kflr = (2 * K * 9 + 2 * 25) + (2 * 2 * K * 4 * 3 + 2 * K * 16 + 2 * 9) + sqrt
    assert flops(p, "KFLR") == kflr
    assert flops(p, "KFAC") == (2 * 9 + 2 * 25) + (2 * 2 * 4 * 3 + 2 * 16 + 2 * 9)
    assert floors.floor(p, "KFLR").bytes == 4 * (9 + 25 + 16 + 9)
    # KFRA: mean loss Hessian N·C², B₁ = W₂ᵀB₂W₂ ⊙ mean φ'φ'ᵀ, both A's
    assert flops(p, "KFRA") == 2 * 16 + (2 * 16 * 3 + 2 * 4 * 9 + 2 * 9) + (2 * 25 + 2 * 9)
    # tangent forward: Ẇa on the first layer, Wȧ + Ẇa on the second
    assert flops(p, "GGN_matvec") == 2 * 2 * 3 * 5 + 2 * 2 * 2 * 4 * 3


def test_conv_floors_with_stride():
    p = conv_problem()
    K, P = C - 1, 9  # the conv: I = 18, O = 3
    # KFAC: conv B N·P·O², A N·P·I² (no data backward); linear: one column back, B, A
    kfac = (N * P * 3 * 3 + N * P * 18 * 18) + (2 * N * 4 * 27 + N * 16 + N * 27 * 27)
    assert flops(p, "KFAC") == kfac
    # bytes: the factors and the conv's patches [N, P, I]
    assert floors.floor(p, "KFAC").bytes == 4 * (3 * 3 + 18 * 18 + N * P * 18 + 16 + 27 * 27)
    # BatchL2Grad: squaring per-sample gradients, 2·N·O·I = 216, beats ghost norms,
    # N·P²·(I+O) + 2·N·P² = 3726; the bias: per-sample sums N·P·O = 54, their norms 2·N·O = 12
    conv_l2 = 216 + 54 + 12
    assert flops(p, "BatchL2Grad") == conv_l2 + (2 * N * 31 + N) + 2 * N * 4
    # exact diagonal: per-column gradients of the conv, K columns back through the linear
    conv_diag = N * K * (2 * P * 3 * 18 + 2 * 3 * 18) + 2 * N * K * 3 + N * K * P * 3
    linear = 2 * N * K * 4 * 27 + (2 * N * 4 * 27 + 2 * N * K * 4 + N * 27) + 2 * N * K * 4
    assert flops(p, "DiagGGNExact") == conv_diag + linear + 2 * N * C * K


def tiny_gpt():
    build = lambda: gpt(vocab=5, d=8, heads=2, seq_len=3)
    return Problem("tinygpt", "", build, _next_tokens(3, 5), N)


def test_decoder_layers_above_attention_are_positionwise():
    s = floors.structure(tiny_gpt())
    assert (s.samples, s.rows, s.classes) == (N, 3, 5)
    flags = {layer.name.removeprefix("model."): layer.positionwise for layer in s.layers}
    assert flags == {
        "block.attn.qkv": False,
        "block.attn.proj": True,
        "block.fc": True,
        "block.out": True,
        "head": True,
    }


def test_exact_columns_on_a_decoder_grow_with_rows_only_below_the_attention():
    """qkv: N samples of R·(C−1) = 12 columns over 3 positions; above: N·R rows of C−1 = 4."""
    R, V, T = 3, 5, 3
    K = V - 1
    qkv = 2 * N * R * K * T * 24 * 8 + N * R * K * T * 24**2 + N * T * 64
    proj = 2 * N * R * K * 8 * 8 + N * R * K * 64 + N * T * 64
    fc = 2 * N * R * K * 16 * 8 + N * R * K * 256 + N * T * 64
    out = 2 * N * R * K * 8 * 16 + N * R * K * 64 + N * T * 256
    head = 2 * N * R * K * 5 * 8 + N * R * K * 25 + N * T * 64
    assert flops(tiny_gpt(), "KFLR") == qkv + proj + fc + out + head + 2 * N * R * V * K


def test_unknown_quantity_and_kfra_on_convs_raise():
    with pytest.raises(ValueError, match="no floor for quantity 'hooks'"):
        floors.floor(mlp_problem(), "hooks")
    with pytest.raises(ValueError, match="KFRA is counted for Linear chains only"):
        floors.floor(conv_problem(), "KFRA")


def test_calibration_and_floor_time():
    cal = floors.calibrate(size=64, megabytes=1, reps=1)
    assert cal.flops_per_s > 0 and cal.bytes_per_s > 0 and cal.threads == torch.get_num_threads()
    f = floors.Floor("p", "q", flops=2e9, bytes=1e9)
    assert f.ms(floors.Calibration(1e12, 1e10, 1)) == pytest.approx(100.0)  # memory-bound
    assert f.ms(floors.Calibration(1e9, 1e12, 1)) == pytest.approx(2000.0)  # compute-bound


def test_table_columns_measure_the_extra_time_against_the_floor():
    plain = [1e-3, 2e-3, 1e-3]
    step = Result("p", "KFAC", "curvopt", times=[3e-3, 6e-3, 4e-3])
    step.ratios = [t / b for t, b in zip(step.times, plain)]  # extra 2, 4, 3 ms: median 3
    results = [Result("p", PLAIN, "plain", times=plain, ratios=[1.0] * 3), step]
    table = markdown_table(
        results,
        {"p": {"plain_ms": 1.0}},
        ["curvopt"],
        targets={},
        floors={("p", "KFAC"): floors.Floor("p", "KFAC", 3e9, 5e6)},
        calibration=floors.Calibration(1e12, 1e9, 1),  # 3 ms of flops, 5 ms of bytes
    )
    header, _, plain_row, row = table.splitlines()
    assert "| floor GFLOP | floor MB | floor ms | measured/floor |" in header
    assert row.split("|")[4:8] == [" 3 ", " 5 ", " 5 ", " 0.6 "]
    assert plain_row.count("|") == header.count("|")


def test_cli_floors_option(tmp_path, capsys):
    path = tmp_path / "o.json"
    argv = ["--problems", "logreg", "--quantities", "BatchGrad", "hooks", "--batch", "4"]
    argv += ["--rounds", "1", "--warmup", "1", "--max-seconds", "0", "--min-sample-ms", "0.1"]
    argv += ["--threads", "1", "--backends", "curvopt", "--floors", "--json", str(path)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "floor GFLOP" in out and "GFLOP/s, copy" in out
    data = json.loads(path.read_text())
    assert data["calibration"]["gemm_gflop_per_s"] > 0
    (cell,) = data["floors"]  # hooks has no floor
    assert cell["quantity"] == "BatchGrad" and cell["floor_gflop"] == 0
    assert cell["floor_mb"] == pytest.approx(4 * 4 * 7850 / 1e6)
    expected = cell["measured_extra_ms"] / cell["floor_ms"]
    assert cell["measured_over_floor"] == pytest.approx(expected)


def test_every_case_of_the_comparison_sets_has_a_floor():
    """The BackPACK and curvlinops case sets (and All-CNN-C) on the benchmark's own networks:
    a positive floor, one layer per Linear/Conv2d with trainable parameters."""
    cases = BACKPACK_CASES + CURVLINOPS_CASES + [("allcnnc", "DiagGGNExact")]
    for pname, q in cases:
        f = floors.floor(PROBLEMS[pname].resized(2), q)
        assert f.bytes > 0 and (f.flops > 0) == (q != "BatchGrad"), (pname, q)
    assert len(floors.structure(PROBLEMS["3c3d"].resized(2)).layers) == 6
    gpt_linear = floors.structure(PROBLEMS["gpt"].resized(2), linear_only=True)
    assert [layer.name for layer in gpt_linear.layers][-1] == "model.block.out"  # head: tied


def test_layer_shapes_agree_with_torch_flop_counter():
    """Independent of the hand counts: each layer's forward product ``2·N·P·O·I``, as read from
    the walked shapes, is what ``torch.utils.flop_counter`` counts for the strided conv and the
    linear; the matvec's tangent forward is one such product for the conv (no input tangent)
    and two for the linear."""
    model, X, _, _ = conv_problem().build()
    counts = []
    for layer, inputs in (model[0], X), (model[2], model[1](model[0](X))):
        with FlopCounterMode(display=False) as counter:
            layer(inputs)
        counts.append(counter.get_total_flops())
    conv, linear = floors.structure(conv_problem()).layers
    assert [2 * N * ly.positions * ly.outputs * ly.inputs for ly in (conv, linear)] == counts
    assert flops(conv_problem(), "GGN_matvec") == counts[0] + 2 * counts[1]
