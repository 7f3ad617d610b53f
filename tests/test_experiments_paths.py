"""Result files record no absolute paths of the machine they were written on."""

from __future__ import annotations

import json
import re
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


def test_ttr_summary_records_no_absolute_path(tmp_path, monkeypatch, capsys):
    out, data = tmp_path / "results", tmp_path / "data"
    argv = ["ttr", "--quick", "--synthetic", "--problems", "mnist_logreg", "--optimizers", "adam"]
    argv += ["--seeds", "1", "--max-steps", "5", "--json", str(out), "--data-root", str(data)]
    monkeypatch.setattr(sys, "argv", ["experiments", *argv])  # what the command line was
    assert main(argv) == 0
    written = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("written:")]
    assert written and not any(_MACHINE_PATH.search(ln) for ln in written), written
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


#: an absolute path of the writing machine: a root folder after a start, space, quote, ``=`` or
#: bracket (``/work/...``, ``/tmp/...``, ``/home/...``), in any committed text file (logs too)
_MACHINE_PATH = re.compile(r"(?:^|[\s\"'=(\[:,])/(?:work|home|tmp|Users|root|opt|usr|var|mnt)/")


#: the folders of committed results: the experiments' and the benchmarks'
RESULTS = (REPO / "experiments" / "results", REPO / "benchmarks" / "results")


def test_committed_result_files_and_logs_hold_no_machine_path():
    files = [p for root in RESULTS for p in sorted(root.rglob("*")) if p.is_file()]
    assert any(p.suffix == ".log" for p in files)
    offending = []
    for path in files:
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        hits = [m.group(0) for m in _MACHINE_PATH.finditer(text)]
        if hits:
            offending.append(f"{path.relative_to(REPO)}: {hits[:2]}")
    assert not offending, offending[:5]


def test_the_machine_path_pattern_finds_what_it_must():
    assert _MACHINE_PATH.search("written: /work/main/results/summary.json")
    assert _MACHINE_PATH.search('File "/tmp/wvit/curvopt/optim/kfac.py", line 3')
    assert not _MACHINE_PATH.search("written: experiments/results/ttr/summary.json")
    assert not _MACHINE_PATH.search("<site-packages>/torch/_inductor/lowering.py ratio 1/2")


def test_a_benchmark_records_its_arguments_portably(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    arguments = ["--data-root", str(tmp_path / "data"), "--out=/elsewhere/x", "--seeds", "3"]
    assert list(map(commands.portable_argument, arguments)) == [
        "--data-root", "data", "--out=.../x", "--seeds", "3"
    ]
