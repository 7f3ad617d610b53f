"""Time-to-result figures from the benchmark's ``ttr_rows.json`` (``python -m experiments ttr``).

* ``ttr_bars.png``: per problem, one bar per optimizer (and preset): the median training time
  to the target over the seeds, whiskers from the first to the third quartile (from the table
  of ``ttr_summary.json``; "not reached" counts as infinite); an optimizer whose median run did
  not reach the target gets an empty bar up to the cap, labelled.
* ``ttr_curves.png``: per problem and group of optimizers (first order, diagonal, Kronecker
  per preset; at most four lines a panel), test accuracy against training wall-clock
  (evaluation time excluded) of each optimizer's tuning run, Adam in every panel for
  reference, the seeds' times to the target as dots on the dotted target line.
"""

from __future__ import annotations

import json
from pathlib import Path

from .common import (
    new_figure,
    optimizer_color,
    optimizer_title,
    ordered_keys,
    problem_title,
    save,
)

ROWS, SUMMARY = "ttr_rows.json", "ttr_summary.json"


def load_ttr(results_dir: str | Path) -> tuple[list[dict], dict, list[dict]]:
    """``(rows, meta, table)`` from ``results_dir`` (empty when there is no benchmark there)."""
    folder = Path(results_dir)
    if not (folder / ROWS).is_file():
        return [], {}, []
    rows = json.loads((folder / ROWS).read_text())
    summary = folder / SUMMARY
    summary = json.loads(summary.read_text()) if summary.is_file() else {}
    return rows, summary.get("meta", {}), summary.get("table", [])


def entry_label(row: dict) -> str:
    return optimizer_title(row["optimizer"]) + (f" ({row['preset']})" if row["preset"] else "")


def _by_problem(rows: list[dict]) -> dict[str, dict[str, list[dict]]]:
    """problem -> entry label -> rows, problems in the paper's order, entries as they come."""
    out: dict[str, dict[str, list[dict]]] = {}
    for row in rows:
        out.setdefault(row["problem"], {}).setdefault(entry_label(row), []).append(row)
    return {p: out[p] for p, _ in ordered_keys((p, False) for p in out)}


def _cap(meta: dict, problem: str, runs: list[dict]) -> float:
    cap = meta.get("problems", {}).get(problem, {}).get("time_cap_s")
    return cap if cap is not None else max(r["train_s"] for r in runs)


def _style(row: dict) -> str:
    return "--" if row["preset"] == "practical" else "-"


def plot_bars(rows: list[dict], meta: dict, table: list[dict], out_dir: Path) -> Path:
    """Bars of the summary's median time to target, whiskers q1..q3 (to the edge: not reached)."""
    groups = _by_problem(rows)
    scores = {(e["problem"], e["optimizer"], e["preset"]): e for e in table}
    fig = new_figure(5.5 * len(groups), 0.45 * max(len(e) for e in groups.values()) + 1.6)
    fig.subplots_adjust(left=0.14, right=0.97, bottom=0.18, top=0.85, wspace=0.6)
    for i, (problem, entries) in enumerate(groups.items()):
        ax = fig.add_subplot(1, len(groups), i + 1)
        all_runs = [r for runs in entries.values() for r in runs]
        cap = _cap(meta, problem, all_runs)
        right = 1.3 * max([cap] + [r["time_to_target"] or 0.0 for r in all_runs])
        for y, runs in enumerate(entries.values()):
            e = scores[(problem, runs[0]["optimizer"], runs[0]["preset"])]
            color = optimizer_color(e["optimizer"])
            count = f"({e['reached']}/{e['seeds']})"
            if e["median_s"] is None:
                ax.barh(y, cap, color="none", edgecolor=color, hatch="//")
                ax.text(cap * 0.02, y, f"not reached {count}", va="center", fontsize=7)
                continue
            q3 = right if e["q3_s"] is None else e["q3_s"]
            ax.barh(y, e["median_s"], color=color, alpha=0.8)
            ax.plot([e["q1_s"], q3], [y, y], color="black", lw=1)
            ax.text(q3, y, f" {e['median_s']:.1f}s {count}", va="center", fontsize=7)
        ax.axvline(cap, color="black", ls=":", lw=1)
        ax.set_yticks(range(len(entries)), list(entries), fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, right * 1.15)
        ax.set_xlabel(
            "training wall-clock to the target, s (median, quartiles; dotted: cap)", fontsize=8
        )
        ax.set_title(f"{problem_title(problem)}: test acc ≥ {all_runs[0]['target']:g}", fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(_caption(meta), fontsize=8)
    return save(fig, out_dir / "ttr_bars.png")


#: the entry drawn in every panel for reference
REFERENCE = ("adam", None)


def _panel(row: dict) -> str:
    """Which panel of its problem an entry goes into: few lines per panel."""
    if row["preset"] is None:
        return "first order"
    kind = "diagonal" if row["optimizer"].startswith("diag") else "Kronecker"
    return f"{kind}, {row['preset']} preset"


def _seed0(runs: list[dict]) -> dict:
    """The tuning run (lowest seed): it trains for the whole cap, the others stop at the
    target."""
    return min(runs, key=lambda r: r["seed"])


def plot_accuracy(rows: list[dict], meta: dict, out_dir: Path) -> Path:
    return save(accuracy_figure(rows, meta), out_dir / "ttr_curves.png")


def accuracy_figure(rows: list[dict], meta: dict):
    """Per problem (row) and group of optimizers (column): test accuracy against training time
    of each optimizer's tuning run (one line each, Adam for reference in every panel), the
    other seeds' times to the target as marks on the dotted target line."""
    groups = _by_problem(rows)
    panels = {problem: _group_panels(entries) for problem, entries in groups.items()}
    cols = max(len(p) for p in panels.values())
    fig = new_figure(4.2 * cols, 3.3 * len(groups) + 0.6)
    fig.subplots_adjust(left=0.05, right=0.99, bottom=0.08, top=0.9, wspace=0.22, hspace=0.45)
    for i, (problem, by_panel) in enumerate(panels.items()):
        entries = groups[problem]
        reference = next(
            (
                runs
                for runs in entries.values()
                if (runs[0]["optimizer"], runs[0]["preset"]) == REFERENCE
            ),
            None,
        )
        target = next(iter(entries.values()))[0]["target"]
        for j, (title, labels) in enumerate(by_panel.items()):
            ax = fig.add_subplot(len(groups), cols, i * cols + j + 1)
            shown = [(label, entries[label], False) for label in labels]
            if reference is not None and entry_label(reference[0]) not in labels:
                shown.insert(0, (entry_label(reference[0]) + " (reference)", reference, True))
            top = target
            for label, runs, is_reference in shown:
                color = "black" if is_reference else optimizer_color(runs[0]["optimizer"])
                style = "-." if is_reference else _style(runs[0])
                run = _seed0(runs)
                if run["curve"]:
                    t, acc = zip(*run["curve"])
                    top = max(top, *acc)
                    ax.plot(t, acc, style, color=color, lw=1.2 - 0.4 * is_reference, label=label)
                hits = [r["time_to_target"] for r in runs if r["time_to_target"] is not None]
                ax.plot(hits, [target] * len(hits), "o", color=color, ms=4, alpha=0.8)
            ax.axhline(target, color="black", ls=":", lw=1)
            ax.set_ylim(max(0.0, target - 0.2), min(1.0, max(target + 0.05, top + 0.02)))
            ax.set_xlabel("training wall-clock, s (evaluation excluded)", fontsize=7)
            if j == 0:
                ax.set_ylabel("test accuracy", fontsize=8)
            ax.set_title(f"{problem_title(problem)}: {title}", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6.5, loc="lower right")
    fig.suptitle(
        _caption(meta) + "\nlines: each optimizer's tuning run (seed 0, whole cap); dots: the "
        "seeds' times to the target (dotted line)",
        fontsize=8,
    )
    return fig


def _group_panels(entries: dict[str, list[dict]]) -> dict[str, list[str]]:
    """panel title -> entry labels, in the order the entries come."""
    out: dict[str, list[str]] = {}
    for label, runs in entries.items():
        out.setdefault(_panel(runs[0]), []).append(label)
    return out


def _caption(meta: dict) -> str:
    parts = [meta.get("date", ""), meta.get("machine", ""), f"{meta.get('threads', '?')} thread(s)"]
    text = "; ".join(p for p in parts if p)
    return ("SYNTHETIC DATA - " if meta.get("synthetic") else "") + text


def plot_ttr(results_dir: str | Path, out_dir: str | Path) -> list[Path]:
    """Both figures for the benchmark in ``results_dir``; ``[]`` if there is none."""
    rows, meta, table = load_ttr(results_dir)
    if not rows:
        return []
    out = Path(out_dir)
    return [plot_bars(rows, meta, table, out), plot_accuracy(rows, meta, out)]
