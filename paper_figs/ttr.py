"""Time-to-result figure from a ``python -m experiments ttr`` results folder.

``ttr.png``: one row per problem, two panels: the problem's metric (test accuracy, or a loss
for the language model and the autoencoder) against optimizer steps, and against estimated
seconds (steps x the interleaved CPU cost per step of ``ttr_cost``, from ``summary.json``).
One line per optimizer: its winning setting's seed-0 run (the lowest seed with a curve; each
run stops at the highest target); dots on the dotted target lines: every seed's steps (or
estimated seconds) to that target. One line per optimizer (about 5 a panel).
"""

from __future__ import annotations

import json
from pathlib import Path

from .common import new_figure, optimizer_color, optimizer_title, ordered_keys, problem_metric
from .common import problem_title, save

SUMMARY = "summary.json"
SKIP = {SUMMARY, "cost.json"}


def load_ttr(folder: str | Path) -> tuple[list[dict], dict]:
    """``(entries, summary)`` of a results folder (``[]``, ``{}`` when there are none)."""
    folder = Path(folder)
    if not folder.is_dir():
        return [], {}
    entries = []
    for path in sorted(folder.glob("*.json")):
        if path.name not in SKIP:
            entry = json.loads(path.read_text())
            # a calibration entry (a problem without targets yet) is not drawn
            if {"problem", "optimizer", "runs"} <= set(entry) and entry["spec"]["targets"]:
                entries.append(entry)
    summary = folder / SUMMARY
    return entries, json.loads(summary.read_text()) if summary.is_file() else {}


def _costs(summary: dict) -> dict[tuple[str, str], float]:
    return {
        (r["problem"], r["optimizer"]): r["cost_per_step_s"]
        for r in summary.get("table", [])
        if r.get("cost_per_step_s")
    }


def ttr_figure(entries: list[dict], summary: dict):
    """The figure (see the module doc)."""
    problems = [p for p, _ in ordered_keys((e["problem"], False) for e in entries)]
    problems = list(dict.fromkeys(problems))
    costs = _costs(summary)
    fig = new_figure(10.0, 3.4 * len(problems) + 0.5)
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.1, top=0.9, wspace=0.2, hspace=0.45)
    for i, problem in enumerate(problems):
        own = [e for e in entries if e["problem"] == problem]
        targets = own[0]["spec"]["targets"]
        for j, axis in enumerate(("steps", "estimated seconds")):
            ax = fig.add_subplot(len(problems), 2, 2 * i + j + 1)
            for entry in own:
                scale = 1.0 if j == 0 else costs.get((problem, entry["optimizer"]))
                if scale is None:
                    continue
                color = optimizer_color(entry["optimizer"])
                drawn = [r for r in entry["runs"] if r["curve"]]
                if not drawn:
                    continue
                run = min(drawn, key=lambda r: r["seed"])  # seed 0 unless its curve is missing
                steps, _, acc = zip(*run["curve"])
                label = optimizer_title(entry["optimizer"])
                ax.plot([s * scale for s in steps], acc, color=color, lw=1.3, label=label)
                for t in targets:
                    hits = [r["steps_to"][f"{t:g}"] for r in entry["runs"]]
                    xs = [h * scale for h in hits if h is not None]
                    ax.plot(xs, [t] * len(xs), "o", color=color, ms=4, alpha=0.8)
            for t in targets:
                ax.axhline(t, color="black", ls=":", lw=1)
            lower = own[0]["spec"].get("lower_is_better", False)
            ax.set_ylim(*_window(targets, lower))
            metric = problem_metric(problem)
            ax.set_xlabel(axis if j == 0 else "estimated seconds (steps × CPU cost/step)")
            ax.set_ylabel(metric)
            ax.set_title(f"{problem_title(problem)}: {metric} vs {axis}", fontsize=9)
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7, loc="upper right" if lower else "lower right")
    meta = summary.get("meta", {})
    fig.suptitle(
        ("SYNTHETIC DATA - " if meta.get("synthetic") else "")
        + "each optimizer's winning setting, seed 0 (lines); every seed's time to a target "
        + f"(dots); {meta.get('threads', '?')} thread(s), {meta.get('machine', '')}",
        fontsize=8,
    )
    return fig


def _window(targets, lower_is_better: bool) -> tuple[float, float]:
    """The y range around the targets (ordered in the metric's direction): an accuracy's from
    0.1 below the first to just above the last (at most 1); a loss's from just below the
    lowest to a quarter of the lowest above the highest, so that the approach shows."""
    if not lower_is_better:
        return targets[0] - 0.1, min(1.0, targets[-1] + 0.03)
    low, high = min(targets), max(targets)
    return low * 0.97, high + 0.25 * low


def plot_ttr(results_dir: str | Path, out_dir: str | Path) -> list[Path]:
    """``ttr.png`` for the results folder ``results_dir``; ``[]`` if it holds no entries."""
    entries, summary = load_ttr(results_dir)
    if not entries:
        return []
    return [save(ttr_figure(entries, summary), Path(out_dir) / "ttr.png")]
