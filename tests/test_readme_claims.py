"""The README's prose agrees with the tables it describes: each numeric claim beside the
time-to-result table is recomputed from the table as it stands (parsed from the Markdown), and
every number in that prose is one of the claims checked here, so that a new number needs a
check. The table's derived columns agree with its measured ones."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()

#: a number standing alone in prose (not inside a name such as ``fmnist_2c2d`` or a version)
NUMBER = r"(?<![\w.])\d+(?:\.\d+)?(?![\w]|\.\d)"


def _section(start: str) -> str:
    """The README from the paragraph starting with ``start`` to the next bold heading."""
    text = README.split(start, 1)[1]
    return text.split("\n**", 1)[0]


def _table(section: str) -> list[dict[str, str]]:
    """The first Markdown table of ``section`` as rows of {header: cell}."""
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    assert set(lines[1].replace("|", "")) <= set("-: "), lines[1]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    return [dict(zip(header, row)) for row in cells]


def _prose_after_table(section: str) -> str:
    """The paragraph after the table of ``section`` (its lines up to a blank one)."""
    after = section.split("\n", 1)[1].rsplit("|\n", 1)[1]
    return after.strip().split("\n\n", 1)[0]


TTR = _section("**Time to result**")
ROWS = _table(TTR)
CLAIMS = _prose_after_table(TTR)


def _groups() -> dict[str, dict[str, dict[str, float]]]:
    """Per problem: the rows of Adam, the best peer and curvopt's fastest, their numbers."""
    by_problem: dict[str, list[dict[str, str]]] = {}
    for row in ROWS:
        by_problem.setdefault(row["problem, target"].split(",")[0], []).append(row)
    groups = {}
    for problem, rows in by_problem.items():
        numbers = [
            {k: float(row[k]) for k in ("steps", "ms/step", "est. s", "× Adam", "× best peer")}
            for row in rows
        ]
        (adam,) = [n for n, row in zip(numbers, rows) if row["optimizer (winning setting)"]
                   .startswith("adam,")]  # fmt: skip
        peers = [n for n in numbers[:-1] if n["× best peer"] == 1.0]
        assert len(peers) == 1, problem  # one best peer (Adam itself where it is)
        groups[problem] = {"adam": adam, "peer": peers[0], "curvopt": numbers[-1]}
    return groups


GROUPS = _groups()


def test_the_table_has_adam_the_best_peer_and_curvopt_per_problem():
    """As its introduction says: per problem Adam (× Adam 1.00), the best peer (× best peer
    1.00, Adam where Adam is the fastest peer) and curvopt's fastest, last."""
    assert len(GROUPS) == 5
    for problem, group in GROUPS.items():
        assert group["adam"]["× Adam"] == 1.0, problem
        assert 2 <= sum(r["problem, target"].startswith(problem + ",") for r in ROWS) <= 3


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r["optimizer (winning setting)"])
def test_derived_columns_agree_with_the_measured_ones(row):
    """est. s = steps × ms/step (within the rounding of ms/step to 0.1)."""
    steps, ms, est = (float(row[k]) for k in ("steps", "ms/step", "est. s"))
    assert steps * (ms - 0.05) / 1000 - 0.05 <= est <= steps * (ms + 0.05) / 1000 + 0.05, row


def test_the_ratios_are_the_times_of_their_rows():
    """× Adam and × best peer are est. s over Adam's and the best peer's (both rounded to 0.1 s,
    so only where the times are large enough to say)."""
    for group in GROUPS.values():
        for row in group.values():
            for column, base in (("× Adam", group["adam"]), ("× best peer", group["peer"])):
                if base["est. s"] >= 10:
                    assert row[column] == pytest.approx(row["est. s"] / base["est. s"], abs=0.02)


def _claim(pattern: str) -> re.Match:
    match = re.search(pattern, " ".join(CLAIMS.split()))
    assert match, (pattern, CLAIMS)
    return match


def test_steps_against_adam():
    fewer = [p for p, g in GROUPS.items() if g["curvopt"]["steps"] < g["adam"]["steps"]]
    match = _claim(r"fewer steps than Adam on (\d+) of the (\d+) problems")
    assert (int(match[1]), int(match[2])) == (len(fewer), len(GROUPS))


def test_steps_against_the_best_peer():
    fewer = [p for p, g in GROUPS.items() if g["curvopt"]["steps"] < g["peer"]["steps"]]
    match = _claim(r"fewer than the best peer on (\d+) \(([^)]*)\)")
    assert int(match[1]) == len(fewer)
    assert [name.strip() for name in match[2].split(",")] == fewer


def test_cost_per_step_and_time_against_the_best_peer():
    _claim(r"Its step costs more than the best peer's on every problem")
    assert all(g["curvopt"]["ms/step"] > g["peer"]["ms/step"] for g in GROUPS.values())
    _claim(r"reaches no target first")
    ratios = [g["curvopt"]["× best peer"] for g in GROUPS.values()]
    assert min(ratios) > 1
    match = _claim(r"takes (\d+\.\d+)–(\d+\.\d+)× the best peer's time")
    assert (float(match[1]), float(match[2])) == (min(ratios), max(ratios))


def test_every_number_of_the_claims_is_checked():
    """The numbers of the prose are those the tests above check, nothing more."""
    numbers = re.findall(NUMBER, CLAIMS)
    ratios = [g["curvopt"]["× best peer"] for g in GROUPS.values()]
    checked = {"4", "5", "3", f"{min(ratios):.2f}", f"{max(ratios):.2f}"}
    assert numbers and set(numbers) <= checked, numbers


def test_the_swap_shows_its_two_lines():
    """The swap is described as two lines, and its block shows both (the ``extend`` and the
    optimizer), with no collection block (the optimizer collects on its own)."""
    assert "in one line" not in README
    assert "takes two lines, `curvopt.extend(model)` and the optimizer" in " ".join(
        README[:1000].split()
    )
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    (swap,) = [b for b in blocks if "was torch.optim.SGD" in b]
    assert "curvopt.extend(model)" in swap and "curvopt.optim.KFAC(" in swap


def test_one_style_of_collection_no_block_where_none_is_needed():
    """The README's optimizers collect on their own: no ``with opt.collect()`` block in its
    code."""
    assert "opt.collect()" not in README


def test_a_table_is_followed_by_a_blank_line():
    """A line of prose right after a table renders as one more row."""
    lines = README.splitlines()
    for i, line in enumerate(lines[:-1]):
        if line.startswith("|"):
            assert lines[i + 1].startswith("|") or not lines[i + 1].strip(), lines[i + 1]
