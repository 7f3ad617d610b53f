"""Set-up that says what it does: ``make test`` installs nothing outside ``.venv``; Debian's
chromium comes only from ``make browser`` (CI's ``.ci/run`` runs it), which without root says in
one line what to run; ``apt-get`` installs of the data sets show their output. (``make`` itself
need not be installed: the Makefile's rules are read as text, the browser rule run by ``sh``.)"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from experiments import fetch_data

ROOT = Path(__file__).resolve().parents[1]
MAKEFILE = (ROOT / "Makefile").read_text()


def _rules() -> dict[str, tuple[list[str], str]]:
    """target -> (prerequisites, recipe with its continuation lines joined)."""
    rules: dict[str, tuple[list[str], str]] = {}
    joined = MAKEFILE.replace("\\\n", " ")
    for match in re.finditer(r"^([\w$().-]+):([^=\n]*)\n((?:\t.*\n?)*)", joined, re.M):
        prerequisites = match[2].split("##")[0].split()
        rules[match[1]] = (prerequisites, match[3])
    return rules


def _needs(target: str, rules) -> set[str]:
    """``target`` and every rule it depends on, transitively."""
    seen, todo = set(), [target]
    while todo:
        name = todo.pop()
        if name not in seen and name in rules:
            seen.add(name)
            todo.extend(rules[name][0])
    return seen


@pytest.mark.parametrize("target", ["test", "docs", "run"])
def test_make_targets_install_nothing_system_wide(target):
    rules = _rules()
    needs = _needs(target, rules)
    assert "browser" not in needs and {"$(STAMP)", target} <= needs, needs
    for name in needs:
        assert "apt-get" not in rules[name][1], (target, name)
        assert "--quiet" not in rules[name][1] and ">/dev/null" not in rules[name][1], name


def test_ci_installs_the_browser_before_the_tests():
    commands = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
                if line.startswith("make")]  # fmt: skip
    assert commands == ["make browser", "make test"]


def test_the_browser_rule_without_root_says_what_to_run(tmp_path):
    """No chromium, not root: one line naming the command, a failing status, nothing run."""
    (recipe,) = [_rules()["browser"][1]]
    script = recipe.strip().lstrip("@").replace("$$", "$")
    fake_id = tmp_path / "id"
    fake_id.write_text("#!/bin/sh\necho 1000\n")
    fake_id.chmod(0o755)
    result = subprocess.run(
        ["/bin/sh", "-c", script], env={"PATH": str(tmp_path)}, capture_output=True, text=True
    )
    assert result.returncode != 0
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 and "apt-get install chromium" in lines[0], result.stdout
    assert "chromium is missing" in lines[0]


def test_apt_installs_of_the_data_sets_show_their_output(monkeypatch, capsys):
    """``fetch_data`` announces an apt-get install and leaves apt's output on the terminal."""
    calls = []

    def run(command, **options):
        calls.append((command, options))
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(fetch_data.subprocess, "run", run)
    fetch_data._apt_install("fortunes")
    assert "installing Debian's fortunes system-wide: apt-get install" in capsys.readouterr().out
    assert calls and all(
        not options.get("capture_output") and "stdout" not in options for _, options in calls
    )


def test_readme_says_what_each_target_installs():
    readme = " ".join((ROOT / "README.md").read_text().split())
    for words in ("`make browser`", "`dataset-fashion-mnist`", "`fortunes-min`",
                  "`DataMissingError`", "skips, saying so"):  # fmt: skip
        assert words in readme, words
