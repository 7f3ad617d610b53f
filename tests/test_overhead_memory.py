"""Tests of the overhead benchmark's peak-memory column (``experiments.overhead.memory``): the
measuring child on allocations of known size, the table, and a competitor's column omitted with
one line saying why when it is not importable. Timings are never asserted."""

import pytest

from experiments.overhead import cli
from experiments.overhead import memory as om
from experiments.overhead.backends import BACKENDS
from experiments.overhead.cases import PLAIN
from experiments.overhead.report import memory_table

pytestmark = pytest.mark.skipif(
    om.unsupported_reason() is not None, reason="needs Linux's resettable VmHWM"
)


def test_child_peak_covers_an_allocation_of_known_size():
    """A 64 MB tensor allocated inside the measured window shows as ≥ 64 MB, and the difference
    to a 16 MB one is the 48 MB between them (not an earlier peak, not kB read as MB)."""
    big = om.run_child({"allocate_mb": 64, "threads": 1})
    small = om.run_child({"allocate_mb": 16, "threads": 1})
    assert big["peak_mb"] >= 64 and small["peak_mb"] >= 16
    assert big["peak_mb"] - small["peak_mb"] == pytest.approx(48, abs=4)


def test_case_peak_holds_the_per_sample_gradients():
    """BatchGrad on the 784-512-256-10 MLP at N=16 keeps ``grad_batch`` for every parameter:
    16 x 535,818 float32 = 34.3 MB must be resident at the peak, and the plain step needs
    less than that; so does the steady-state step (the buffers are held or reused)."""
    spec = {"problem": "mlp", "quantity": "BatchGrad", "threads": 1, "batch": 16}
    grad_batch_mb = 16 * (784 * 512 + 512 + 512 * 256 + 256 + 256 * 10 + 10) * 4 / om.MB
    curvopt = om.run_child({**spec, "backend": "curvopt"})
    plain = om.run_child({**spec, "quantity": PLAIN, "backend": PLAIN})
    assert curvopt["peak_mb"] >= curvopt["steady_mb"] >= grad_batch_mb
    assert plain["peak_mb"] < grad_batch_mb


def test_child_reports_an_unsupported_case_as_na():
    spec = {"problem": "logreg", "quantity": "GGN_matvec", "backend": "torch.func", "threads": 1}
    assert om.run_child(spec)["error"].startswith("n/a: torch.func")


def test_memory_table_cells_and_ratios():
    results = [
        om.MemoryResult("p", PLAIN, PLAIN, 10.0, 9.0),
        om.MemoryResult("p", "KFAC", "curvopt", 30.0, 20.0),
        om.MemoryResult("p", "KFAC", "curvlinops", 60.0, 60.0),
        om.MemoryResult("p", "GGN_matvec", "curvopt", 8.0, 7.5),
        om.MemoryResult("p", "GGN_matvec", "curvlinops", error="n/a: no"),
    ]
    lines = memory_table(results, ["curvopt", "curvlinops"]).splitlines()
    assert lines[0] == "| problem | quantity | plain | curvopt | curvlinops | curvopt/curvlinops |"
    assert lines[2] == "| p | KFAC | 10.0 (9.0) | 30.0 (20.0) | 60.0 (60.0) | 0.50 |"
    assert lines[3].endswith("| 10.0 (9.0) | 8.0 (7.5) | n/a |  |")
    assert "BackPACK" not in memory_table(results, ["curvopt"])


def test_absent_competitor_loses_its_columns_with_one_line_why(monkeypatch, capsys):
    monkeypatch.setattr(
        BACKENDS["curvlinops"], "available", lambda: "not importable (gone for the test)"
    )
    argv = ["--problems", "logreg", "--quantities", "KFAC", "--batch", "4", "--rounds", "1"]
    argv += ["--warmup", "1", "--max-seconds", "0", "--min-sample-ms", "0.1", "--threads", "1"]
    assert cli.main([*argv, "--backends", "curvopt", "curvlinops", "--memory"]) == 0
    out = capsys.readouterr().out
    assert out.count("curvlinops: column omitted, not importable (gone for the test).") == 1
    tables = [line for line in out.splitlines() if line.startswith("| problem |")]
    assert len(tables) == 2  # timing and memory
    assert all("curvopt" in t and "curvlinops" not in t for t in tables)
    assert "| logreg | KFAC |" in out


def test_child_verifies_the_case_like_the_timing_does():
    """BackPACK skips the GPT's LayerNorm with a warning only: the memory cell is n/a, not the
    peak of an incomplete computation."""
    pytest.importorskip("backpack")
    spec = {"problem": "gpt", "quantity": "Variance", "backend": "backpack", "threads": 1}
    assert om.run_child({**spec, "batch": 2})["error"].startswith("n/a: backpack wrote no variance")
