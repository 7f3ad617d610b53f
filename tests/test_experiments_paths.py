"""Result files record no absolute paths of the machine they were written on."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from experiments import commands
from experiments.__main__ import main

REPO = Path(__file__).resolve().parents[1]


def _strings(obj):
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _strings(v)


def _absolute(obj) -> list[str]:
    """Strings holding an absolute path (a word starting with / after a space, = or quote)."""
    return [s for s in _strings(obj) if any(w.startswith("/") for w in s.replace("=", " ").split())]


def test_relative_and_command_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert commands.relative(tmp_path / "out" / "x.json") == os.path.join("out", "x.json")
    assert commands.relative("/elsewhere/data") == ".../data"
    assert commands.relative("results/a") == "results/a"
    line = commands.command_line(["ttr", "--out", "/tmp/B", f"--data-root={tmp_path}/d", "-v"])
    assert line == "python -m experiments ttr --out .../B --data-root=d -v"


def test_ttr_summary_records_no_absolute_path(tmp_path, monkeypatch):
    out, data = tmp_path / "results", tmp_path / "data"
    argv = ["ttr", "--quick", "--synthetic", "--problems", "mnist_logreg", "--optimizers", "adam"]
    argv += ["--seeds", "1", "--max-steps", "5", "--json", str(out), "--data-root", str(data)]
    monkeypatch.setattr(sys, "argv", ["experiments", *argv])  # what the command line was
    assert main(argv) == 0
    for name in ("summary.json", "mnist_logreg_adam.json"):
        found = _absolute(json.loads((out / name).read_text()))
        assert not found, f"{name} records absolute paths: {found}"
    command = json.loads((out / "summary.json").read_text())["meta"]["command"]
    assert command.startswith("python -m experiments ttr") and "--json .../results" in command


def test_committed_results_record_no_absolute_path():
    files = sorted((REPO / "experiments" / "results").rglob("*.json"))
    assert files
    for path in files:
        found = _absolute(json.loads(path.read_text()))
        assert not found, f"{path.relative_to(REPO)} records absolute paths: {found[:3]}"
