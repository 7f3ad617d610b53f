"""Bar chart of the overhead table: each quantity's cost as a ratio to the plain gradient.

    python -m paper_figs.overhead RESULTS_DIR OUT_DIR

Reads every JSON written by ``python -m experiments overhead --json`` below ``RESULTS_DIR`` (or a
single such file) and draws one panel per network and batch size: one group of bars per
quantity, one bar per backend (curvopt, and BackPACK / torch.func / Opacus side by side when the
JSON has them), the bar height the median over interleaved rounds of (time of the step / time
of the plain forward+backward in the same round), the whisker the quartiles. A dashed line
marks 1 = the gradient alone. Cells a backend cannot compute are written as ``n/a``. Where the
JSON has curvopt's head-to-head ratios to BackPACK (``versus_backpack``), the panel title gives
their geometric mean.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import textwrap
from pathlib import Path

from .common import draw_main, load_overheads, new_figure, save

PLAIN = "plain"
QUANTITY_LABELS = {
    "hooks": "hooks only\n(no collect)",
    "BatchGrad": "indiv.\ngradients",
    "BatchL2Grad": "indiv. grad.\nnorms",
    "SumGradSquared": "2nd\nmoment",
    "Variance": "variance",
    "first_order": "all four\nfirst-order",
    "DiagGGNMC": "DiagGGN-MC",
    "DiagGGNExact": "DiagGGN",
    "DiagHessian": "DiagHessian",
    "KFAC": "KFAC",
    "KFLR": "KFLR",
    "KFRA": "KFRA",
}
BACKEND_COLORS = {
    "curvopt": "tab:blue",
    "backpack": "tab:red",
    "torch.func": "tab:green",
    "opacus": "tab:purple",
}
BACKEND_ORDER = ["curvopt", "backpack", "torch.func", "opacus"]


def _batch_size(payload: dict, problem: str) -> int | None:
    info = payload.get("problems", {}).get(problem, {})
    if isinstance(info.get("batch_size"), int):
        return info["batch_size"]
    match = re.search(r"\bN\s*=\s*(\d+)", str(info.get("description", "")))
    return int(match.group(1)) if match else None


def collect_panels(payloads: list[dict]) -> dict[tuple[str, int | None], dict]:
    """``{(problem, batch size): {"cells": {(quantity, backend): result}, "plain_ms", "source"}}``.

    With several files for the same network and batch size the last one read wins.
    """
    panels: dict[tuple[str, int | None], dict] = {}
    for payload in payloads:
        for r in payload["results"]:
            problem = r.get("problem")
            key = (problem, _batch_size(payload, problem))
            panel = panels.setdefault(key, {"cells": {}, "plain_ms": None, "source": None})
            panel["cells"][(r.get("quantity"), r.get("backend"))] = r
            panel["plain_ms"] = payload.get("problems", {}).get(problem, {}).get("plain_ms")
            panel["source"] = payload
    return panels


def _quantity_order(names):
    rank = {q: i for i, q in enumerate(QUANTITY_LABELS)}
    return sorted(names, key=lambda q: (rank.get(q, len(rank)), q))


def _backend_order(names):
    rank = {b: i for i, b in enumerate(BACKEND_ORDER)}
    return sorted(names, key=lambda b: (rank.get(b, len(rank)), b))


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def plot_overhead(results_dir: str | Path, out_dir: str | Path) -> list[Path]:
    """Draw ``overhead.png`` into ``out_dir``; returns the written paths (none without data)."""
    payloads = load_overheads(results_dir)
    if not payloads:
        return []
    panels = collect_panels(payloads)
    keys = sorted(panels, key=lambda k: (str(k[0]), k[1] or 0))
    ncols = min(2, len(keys))
    nrows = math.ceil(len(keys) / ncols)
    width, height = max(9.0, 7.5 * ncols), 1.0 + 4.6 * nrows
    fig = new_figure(width, height)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    layout = dict(left=0.6 / width, right=0.99, bottom=0.55 / height, wspace=0.15, hspace=0.45)
    fig.subplots_adjust(**layout)  # the panels' widths, which their titles are wrapped to
    for ax in axes[len(keys) :]:
        ax.set_visible(False)
    lines = max(_draw_panel(ax, key, panels[key]) for ax, key in zip(axes, keys))
    # room above the first row for the figure's title (3 lines) and the panels' titles
    fig.subplots_adjust(top=1 - (0.75 + _TITLE_LINE_IN * lines) / height)
    src = payloads[-1]
    threads = src.get("threads", "?")
    fig.suptitle(
        "Overhead of each quantity relative to the gradient (plain forward+backward = 1)\n"
        "bars: median over interleaved rounds of the per-round ratio, whiskers: quartiles\n"
        f"torch {src.get('torch', '?')}, {src.get('device', '?')}, {threads} "
        f"thread{'' if threads == 1 else 's'}"
        + (f", {src['cpu_count']} CPUs" if src.get("cpu_count") else "")
        + (
            f", load average {src['load_average_at_start']:.1f} at start"
            if _finite(src.get("load_average_at_start"))
            else ""
        ),
        fontsize=10,
    )
    return [save(fig, Path(out_dir) / "overhead.png")]


def versus_backpack(cells: dict) -> tuple[float, int] | None:
    """Geometric mean of curvopt's per-cell time ratios to BackPACK, and the number of cells."""
    ratios = [
        r["versus_backpack"]
        for (_, backend), r in cells.items()
        if backend == "curvopt" and _finite(r.get("versus_backpack")) and r["versus_backpack"] > 0
    ]
    if not ratios:
        return None
    return math.exp(sum(math.log(v) for v in ratios) / len(ratios)), len(ratios)


#: the height of one line of a panel's title (font size 9), inches
_TITLE_LINE_IN = 0.17


def _wrapped(parts: list[str], ax) -> str:
    """``parts`` as the lines of a title that fits ``ax``'s width (font size 9: about 14
    characters per inch), a part broken only where it is too long alone."""
    chars = int(ax.get_position().width * ax.figure.get_figwidth() * 14)
    return "\n".join(textwrap.fill(part, chars) for part in parts)


def _draw_panel(ax, key, panel) -> int:
    """Draw one problem's bars; returns the number of lines of its title."""
    problem, batch = key
    cells = panel["cells"]
    quantities = _quantity_order({q for q, _ in cells if q != PLAIN})
    backends = _backend_order({b for _, b in cells if b != PLAIN})
    width = 0.8 / max(1, len(backends))
    top = 1.0
    for j, backend in enumerate(backends):
        xs, heights, lows, highs = [], [], [], []
        for i, q in enumerate(quantities):
            r = cells.get((q, backend))
            x = i - 0.4 + width * (j + 0.5)
            if r is None:
                continue
            ratio = r.get("ratio_median")
            if not _finite(ratio):
                note = "n/a" if str(r.get("error", "")).startswith("n/a") else "error"
                ax.text(
                    x,
                    0.05,
                    note,
                    rotation=90,
                    ha="center",
                    va="bottom",
                    fontsize=7,
                    color=BACKEND_COLORS.get(backend, "black"),
                )
                continue
            q1 = r.get("ratio_q1") if _finite(r.get("ratio_q1")) else ratio
            q3 = r.get("ratio_q3") if _finite(r.get("ratio_q3")) else ratio
            xs.append(x)
            heights.append(ratio)
            lows.append(max(0.0, ratio - q1))
            highs.append(max(0.0, q3 - ratio))
            top = max(top, q3)
        if not xs:
            ax.bar([], [], width, label=backend, color=BACKEND_COLORS.get(backend, "gray"))
            continue
        bars = ax.bar(
            xs,
            heights,
            width,
            yerr=[lows, highs],
            capsize=2,
            label=backend,
            color=BACKEND_COLORS.get(backend, "gray"),
            error_kw={"elinewidth": 0.8},
        )
        for rect, h, up in zip(bars, heights, highs):
            ax.annotate(
                f"{h:.2f}",
                (rect.get_x() + rect.get_width() / 2, h + up),
                xytext=(0, 2),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=7,
            )
    ax.axhline(1.0, color="black", linestyle="--", linewidth=0.8, label="gradient (= 1)")
    ax.set_xticks(range(len(quantities)))
    ax.set_xticklabels([QUANTITY_LABELS.get(q, q) for q in quantities], fontsize=8)
    ax.set_ylim(0, top * 1.15)
    ax.set_ylabel("time / time of the gradient")
    plain = panel.get("plain_ms")
    title = f"{problem}" + (f", batch size {batch}" if batch else "")
    if _finite(plain):
        title += f" (gradient: {plain:.1f} ms)"
    parts = [title]
    versus = versus_backpack(cells)
    if versus is not None:
        parts.append(f"curvopt/BackPACK time: {versus[0]:.2f} (geometric mean, {versus[1]} cells)")
    info = panel["source"].get("problems", {}).get(problem, {})
    if _finite(info.get("other_load_median")):
        parts.append(f"other processes used {100 * info['other_load_median']:.0f}% of the CPUs")
    if info.get("description"):
        parts.append(info["description"])
    title = _wrapped(parts, ax)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    return title.count("\n") + 1


def main(argv=None) -> int:
    """``python -m paper_figs.overhead RESULTS OUT``: same as ``python -m paper_figs overhead``."""
    p = argparse.ArgumentParser(prog="python -m paper_figs.overhead", description=__doc__)
    p.add_argument("results_dir", type=Path, help="folder (searched recursively) or one JSON")
    p.add_argument("out_dir", type=Path)
    args = p.parse_args(argv)
    return draw_main(plot_overhead, args.results_dir, args.out_dir)


if __name__ == "__main__":
    sys.exit(main())
