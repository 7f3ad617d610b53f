"""The README and the docs pages read as documentation: prose lines of at most 100 characters
(tables, code and URLs excepted), no commit hashes, run dates or UTC times, and every file or
page they cite exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
IDS = [p.relative_to(ROOT).as_posix() for p in PAGES]
TOP = ("curvopt", "tests", "benchmarks", "experiments", "examples", "docs", "fixtures",
       "paper_figs")


def _prose(text: str):
    """(line number, line) of the lines outside code blocks, tables and indented math."""
    fence = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        if fence or line.startswith("|") or re.search(r"https?://", line):
            continue
        yield number, line


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_prose_lines_are_at_most_100_characters(page):
    long = [f"{n}: {len(line)}" for n, line in _prose(page.read_text()) if len(line) > 100]
    assert not long, long


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_no_history_in_user_docs(page):
    """No commit hash, date of a run, UTC time or "this morning"."""
    text = page.read_text()
    patterns = {
        "commit hash": r"(?<![\w/.-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w/])",
        "date": r"\b20\d\d-\d\d-\d\d\b",
        "UTC time": r"\b\d{1,2}:\d\d(?::\d\d)?\s?(?:Z|UTC)\b|\bUTC\b",
        "morning": r"\bmorning\b",
    }
    for what, pattern in patterns.items():
        found = re.findall(pattern, text)
        assert not found, f"{what}: {found[:5]}"


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_cited_files_exist(page):
    """Every repository path a page names (`curvopt/...`, `tests/...`, ...) and every relative
    link exists."""
    text = page.read_text()
    missing = []
    for path in re.findall(r"`((?:%s)/[\w./-]*\w)`" % "|".join(TOP), text):
        if path.startswith("docs/_build/"):  # what `make docs` builds, not in the repository
            continue
        if not (ROOT / path).exists():
            missing.append(path)
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in target:
            continue
        if not (page.parent / target).exists():
            missing.append(target)
    assert not missing, missing


def test_every_docs_page_is_in_the_site():
    index = (ROOT / "docs" / "index.md").read_text()
    for page in (ROOT / "docs").glob("*.md"):
        if page.stem != "index":
            assert re.search(rf"^{page.stem}$", index, re.M), page.name
