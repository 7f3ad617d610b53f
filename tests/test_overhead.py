"""Tests of the overhead benchmark's machinery (``experiments.overhead``): cases, the BackPACK
column, the CLI. Timings themselves are never asserted."""

import json
import math
import pathlib
import subprocess
import sys

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

from curvopt import extensions as ext
from experiments.overhead import cli, report
from experiments.overhead.backends import Unsupported, backpack_options
from experiments.overhead.cases import PLAIN
from experiments.overhead.problems import PROBLEMS
from experiments.overhead.report import geometric_mean, head_to_head, markdown_table
from experiments.overhead.timing import Result, build_steps


def result(backend, quantity, times, plain):
    r = Result("p", quantity, backend, times=list(times))
    r.ratios = [t / b for t, b in zip(times, plain)]
    return r


def test_backpack_column_is_the_median_per_round_ratio_and_has_a_geometric_mean():
    plain = [1.0, 1.0, 2.0]
    results = [
        result("plain", PLAIN, plain, plain),
        result("curvopt", "DiagGGNMC", [2.0, 3.0, 8.0], plain),  # / backpack: 0.5, 1.0, 2.0
        result("backpack", "DiagGGNMC", [4.0, 3.0, 4.0], plain),
        result("curvopt", "KFAC", [1.0, 1.0, 1.0], plain),  # / backpack: 0.25 each
        result("backpack", "KFAC", [4.0, 4.0, 4.0], plain),
        result("curvopt", "KFLR", [1.0, 1.0, 1.0], plain),
        Result("p", "KFLR", "backpack", error="error: TypeError: no"),
    ]
    assert head_to_head(results[1], results[2]) == 1.0
    assert head_to_head(results[5], results[6]) is None
    table = markdown_table(results, {"p": {"plain_ms": 1.0}}, ["curvopt", "backpack"])
    lines = table.splitlines()
    assert "curvopt/BackPACK" in lines[0]
    row = next(line for line in lines if "| DiagGGNMC |" in line)
    assert row.split("|")[3:6] == [" 3.00 ", " 3.00 ", " 1.00 "]
    assert lines[-1].startswith("| geometric mean |")
    assert f"{math.sqrt(1.0 * 0.25):.2f} (2 cells)" in lines[-1]
    without = markdown_table(results, {"p": {"plain_ms": 1.0}}, ["curvopt"])
    assert "BackPACK" not in without and "geometric mean" not in without


def test_a_cell_of_another_quantity_is_marked_and_left_out_of_the_mean(monkeypatch):
    """A competitor computing another quantity under the same name: its ratio is shown with
    ``≠``, explained below the table, and not averaged."""
    plain = [1.0, 1.0]
    results = [
        result("plain", PLAIN, plain, plain),
        result("curvopt", "KFAC", [1.0, 1.0], plain),  # / curvlinops: 0.5
        result("curvlinops", "KFAC", [2.0, 2.0], plain),
        result("curvopt", "KFLR", [8.0, 8.0], plain),  # / curvlinops: 4, another quantity
        result("curvlinops", "KFLR", [2.0, 2.0], plain),
    ]
    monkeypatch.setattr(report, "DIFFERENT_DEFINITIONS", {("p", "KFLR", "curvlinops"): "why"})
    table = markdown_table(results, {"p": {"plain_ms": 1.0}}, ["curvopt", "curvlinops"])
    lines = table.splitlines()
    assert "| 4.00 ≠ |" in next(line for line in lines if "| KFLR |" in line)
    assert "| 0.50 |" in next(line for line in lines if "| KFAC |" in line)
    mean = next(line for line in lines if line.startswith("| geometric mean |"))
    assert "0.50 (1 cells)" in mean
    assert lines[-1] == "≠ (p, KFLR, curvlinops): why"


def test_geometric_mean():
    assert geometric_mean([2.0, 8.0]) == pytest.approx(4.0)
    assert math.isnan(geometric_mean([]))


def test_backpack_options_drop_only_what_backpack_does_anyway():
    def KFAC(mc_samples=1):  # BackPACK's signature: no kfac_approx
        return None

    assert backpack_options(ext.KFAC(mc_samples=2), KFAC) == {"mc_samples": 2}
    with pytest.raises(Unsupported, match="kfac_approx='reduce'"):
        backpack_options(ext.KFAC(kfac_approx="reduce"), KFAC)


def test_resized_problem_and_gpt_case_run_in_curvopt():
    problem = PROBLEMS["gpt"].resized(2)
    assert problem.batch_size == 2 and problem.description.endswith("N=2")
    steps, failed = build_steps(problem, ["DiagGGNMC"], ["curvopt"])
    assert failed == [] and set(steps) == {("plain", PLAIN), ("curvopt", "DiagGGNMC")}


def test_cli_batch_option_and_json(tmp_path, capsys):
    path = tmp_path / "o.json"
    argv = ["--problems", "logreg", "--quantities", "BatchGrad", "--batch", "4", "--rounds", "1"]
    argv += ["--warmup", "1", "--max-seconds", "0", "--min-sample-ms", "0.1", "--threads", "1"]
    assert cli.main([*argv, "--backends", "curvopt", "--json", str(path)]) == 0
    assert "| logreg | BatchGrad |" in capsys.readouterr().out
    payload = json.loads(path.read_text())
    assert payload["problems"]["logreg"]["batch_size"] == 4
    assert payload["problems"]["logreg"]["description"].endswith("N=4")


def test_cli_profile_runs_at_the_batch_asked_for(capsys):
    argv = ["--profile", "logreg:BatchGrad", "--batch", "3", "--threads", "1"]
    assert cli.main(argv) == 0
    table = capsys.readouterr().out
    assert "logreg:BatchGrad:curvopt" in table
    assert "[3, 784]" in table and "[64, 784]" not in table


def test_cli_explains_the_targets_below_the_table(capsys):
    """The ✓/✗ marks come with their meaning (the main job prints this table too); with another
    batch size there are no targets and no explanation."""
    argv = ["--problems", "mlp", "--quantities", "BatchGrad", "--rounds", "1", "--warmup", "1"]
    argv += ["--max-seconds", "0", "--min-sample-ms", "0.1", "--threads", "1"]
    assert cli.main([*argv, "--backends", "curvopt"]) == 0
    out = capsys.readouterr().out
    assert "| mlp | " in out and ("✓" in out or "✗" in out)
    assert "target (curvopt): the goal" in out and "not that a\ncomputed quantity is wrong" in out
    assert cli.main([*argv, "--backends", "curvopt", "--batch", "3"]) == 0
    assert "target (curvopt): the goal" not in capsys.readouterr().out


def test_old_entry_point_package_loads_no_torch():
    """``python -m experiments.overhead`` imports the package before its ``__main__``, which sets
    ``OMP_WAIT_POLICY`` for OpenMP: the package itself must not load torch first."""
    code = "import sys, experiments.overhead; print('torch' in sys.modules)"
    root = pathlib.Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == "False", run.stderr


def test_cli_calls_counts_each_step_of_each_backend(capsys):
    """``--calls``: a row per case with a count per backend, the plain step's first; a step
    that does more makes more calls (hooks only over plain, a quantity over hooks only)."""
    argv = ["--problems", "logreg", "--quantities", "hooks", "BatchGrad", "--batch", "3"]
    assert cli.main([*argv, "--threads", "1", "--backends", "curvopt", "--calls"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| logreg")]
    counts = {row.split("|")[2].strip(): float(row.split("|")[3].replace(",", "")) for row in rows}
    assert list(counts) == ["plain", "hooks", "BatchGrad"]
    assert 0 < counts["plain"] < counts["hooks"] < counts["BatchGrad"]


def test_cli_operators_counts_the_operators_of_each_step(capsys):
    """``--operators``: the torch operators a step dispatches, the same every step (a whole
    number); the plain step's are those a dispatch mode sees in one step of the plain model,
    and per-sample gradients add operators."""
    argv = ["--problems", "logreg", "--quantities", "BatchGrad", "--batch", "3"]
    assert cli.main([*argv, "--threads", "1", "--backends", "curvopt", "--operators"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| logreg")]
    counts = {row.split("|")[2].strip(): float(row.split("|")[3].replace(",", "")) for row in rows}
    assert list(counts) == ["plain", "BatchGrad"]
    assert all(count == int(count) for count in counts.values())
    assert counts["plain"] == _operators_of(build_steps(PROBLEMS["logreg"].resized(3), [], [])[0])
    assert counts["plain"] < counts["BatchGrad"]


def _operators_of(steps) -> int:
    """The ATen operators one plain step dispatches (after a warm-up step)."""
    step = steps[("plain", PLAIN)]
    step()
    seen = []

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Seen():
        step()
    return len(seen)
