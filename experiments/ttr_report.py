"""Summaries of the time-to-result benchmark: medians and quartiles, the JSON files, the table.

Files written into the output folder (see :func:`write_results`):

* ``ttr_rows.json``: one row per scored run (3 seeds per optimizer and problem), each with
  ``problem``, ``optimizer``, ``preset``, ``seed``, ``target``, ``time_to_target`` (training
  seconds or ``null``), the setting, timings per step and the test-accuracy curve;
* ``ttr_search.json``: the tuning runs (rows of the same form);
* ``ttr_summary.json``: the machine and command (``meta``) and the table (``table``).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from .files import atomic_write

ROWS, SEARCH, SUMMARY = "ttr_rows.json", "ttr_search.json", "ttr_summary.json"


def quartiles(times: list[float | None]) -> tuple[float | None, float | None, float | None]:
    """25 %, 50 % and 75 % of the times (linear interpolation between order statistics),
    "not reached" (``None``) counting as infinite; an infinite quartile is ``None``."""
    values = sorted(math.inf if t is None else t for t in times)

    def at(p: float) -> float:
        pos = p * (len(values) - 1)
        lo, frac = int(pos), pos - int(pos)
        if frac == 0:
            return values[lo]
        return values[lo] + frac * (values[lo + 1] - values[lo])

    return tuple(None if not math.isfinite(v) else v for v in map(at, (0.25, 0.5, 0.75)))


def summarize(rows: list[dict]) -> list[dict]:
    """One entry per (problem, optimizer, preset) in order of appearance."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["problem"], row["optimizer"], row["preset"]), []).append(row)
    table = []
    for (problem, optimizer, preset), runs in groups.items():
        q1, median, q3 = quartiles([r["time_to_target"] for r in runs])
        steps = [r["per_step_s"] for r in runs if r["per_step_s"]]
        per_step = {k: statistics.fmean(s[k] for s in steps) for k in steps[0]} if steps else None
        table.append(
            {
                "problem": problem,
                "optimizer": optimizer,
                "preset": preset,
                "lr": runs[0]["lr"],
                "damping": runs[0]["damping"],
                "target": runs[0]["target"],
                "seeds": len(runs),
                "reached": sum(r["time_to_target"] is not None for r in runs),
                "median_s": median,
                "q1_s": q1,
                "q3_s": q3,
                "per_step_s": per_step,
                "eval_s_mean": statistics.fmean(r["eval_s"] for r in runs),
            }
        )
    return table


def _s(x: float | None) -> str:
    return "not reached" if x is None else f"{x:.1f}"


def markdown_table(table: list[dict]) -> str:
    """The table as markdown: time to target (median [q1, q3]) and seconds per step."""
    lines = [
        "| problem | optimizer | preset | lr | damping | target | reached | time to target, s "
        "(median [q1, q3]) | ms/step: forward / backward / step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for e in table:
        damping = "-" if e["damping"] is None else f"{e['damping']:g}"
        ps = e["per_step_s"]
        step = "-" if ps is None else " / ".join(f"{1e3 * ps[k]:.1f}" for k in ps)
        lines.append(
            f"| {e['problem']} | {e['optimizer']} | {e['preset'] or '-'} | {e['lr']:g} | "
            f"{damping} | {e['target']:g} | {e['reached']}/{e['seeds']} | {_s(e['median_s'])} "
            f"[{_s(e['q1_s'])}, {_s(e['q3_s'])}] | {step} |"
        )
    return "\n".join(lines)


def write_results(out: str | Path, rows: list[dict], search: list[dict], meta: dict) -> Path:
    """Write the three JSON files into ``out``; returns the summary's path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files = {
        ROWS: rows,
        SEARCH: search,
        SUMMARY: {"meta": meta, "table": summarize(rows)},
    }
    for name, content in files.items():
        text = json.dumps(content, indent=1, allow_nan=False)
        atomic_write(out / name, lambda p, text=text: p.write_text(text + "\n"))
    return out / SUMMARY
