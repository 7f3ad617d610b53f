"""Optimizer curves: median and quartiles over seeds, per epoch and against wall-clock time.

    python -m paper_figs curves RESULTS_DIR OUT_DIR

One PNG per problem (``curves_<problem>.png``, ``..._synthetic.png`` for random data; where the
results hold runs of several budgets of a problem, e.g. 1,024 and 5,120 training samples, one
PNG per budget, ``curves_<problem>_<budget>.png``, never one curve of mixed runs): the top
row against epochs, the bottom row against training wall-clock time (the summed ``epoch_s`` of
the run, evaluation excluded), four columns: test loss, test accuracy, train loss, train
accuracy (train = the runner's train-eval set, evaluated without augmentation). One line per
optimizer (the median over seeds) with a shaded band between the quartiles. Where a
results folder holds several hyper-parameter settings of an optimizer (a grid), the one with
the best final validation accuracy of its search run (lowest seed) is drawn (the paper's rule,
as ``experiments.runner.grid`` applies it) and named in the legend.
"""

from __future__ import annotations

from pathlib import Path

from .common import (
    Setting,
    best_settings,
    budget_label,
    budget_slug,
    load_runs,
    new_figure,
    optimizer_color,
    optimizer_title,
    ordered_keys,
    ordered_optimizers,
    problem_title,
    quantiles,
    save,
    varying_budgets,
)

METRICS = (
    ("test_loss", "test loss"),
    ("test_acc", "test accuracy"),
    ("train_loss", "train loss"),
    ("train_acc", "train accuracy"),
)


def _cumulative_time(run: dict) -> list[float]:
    """Training seconds elapsed at the end of each history entry (epoch 0: 0)."""
    out, total = [], 0.0
    for entry in run["history"]:
        total += float(entry.get("time", {}).get("epoch_s", 0.0) or 0.0)
        out.append(total)
    return out


def series(setting: Setting, metric: str) -> dict[str, list[float]]:
    """Per epoch: epoch, median wall-clock, q1/median/q3 of ``metric`` over the seeds that
    reached that epoch (a diverged seed drops out)."""
    by_epoch: dict[int, tuple[list[float], list[float]]] = {}
    for run in setting.runs:
        times = _cumulative_time(run)
        for entry, t in zip(run["history"], times):
            vals, ts = by_epoch.setdefault(int(entry["epoch"]), ([], []))
            if entry.get(metric) is not None:
                vals.append(float(entry[metric]))
                ts.append(t)
    out = {"epoch": [], "time": [], "q1": [], "median": [], "q3": [], "n": []}
    for epoch in sorted(by_epoch):
        vals, ts = by_epoch[epoch]
        if not vals:
            continue
        q1, med, q3 = quantiles(vals)
        out["epoch"].append(epoch)
        out["time"].append(quantiles(ts)[1])
        out["q1"].append(q1)
        out["median"].append(med)
        out["q3"].append(q3)
        out["n"].append(len(vals))
    return out


def _label(setting: Setting) -> str:
    cfg = setting.config
    hp = f"lr={cfg['lr']:g}"
    if cfg.get("damping") is not None:
        hp += f", λ={cfg['damping']:g}"
    n = len(setting.runs)
    return f"{optimizer_title(setting.optimizer)} ({hp}; {n} seed{'s' if n != 1 else ''})"


def _banner(settings: list[Setting], synthetic: bool) -> str:
    parts = []
    if synthetic:
        parts.append("SYNTHETIC DATA (random images and labels) - not a real result")
    notes = sorted({note for s in settings for note in s.budget()})
    if notes:
        parts.append("BUDGETED: " + "; ".join(notes) + " - not comparable to the paper")
    return "\n".join(parts)


def plot_problem(
    problem: str,
    synthetic: bool,
    chosen: dict[str, Setting],
    out_dir: Path,
    budget: tuple | None = None,
    varying: list[str] = (),
) -> Path:
    """One figure of ``chosen`` (runs of one budget). ``varying``: the budget keys that differ
    between the problem's budgets in the results; file name and title give their values."""
    fig = new_figure(17, 8.6)
    axes = fig.subplots(2, len(METRICS), squeeze=False)
    fig.subplots_adjust(left=0.045, right=0.99, top=0.88, bottom=0.15, wspace=0.22, hspace=0.32)
    settings = [chosen[o] for o in ordered_optimizers(chosen)]
    # y-range of each column from the trained epochs (>= 1): the initial point (epoch 0, chance
    # level) would otherwise squeeze the differences between optimizers into a thin strip
    ranges: dict[int, list[float]] = {}
    for s in settings:
        color = optimizer_color(s.optimizer)
        for col, (metric, _) in enumerate(METRICS):
            data = series(s, metric)
            if not data["epoch"]:
                continue
            trained = [i for i, e in enumerate(data["epoch"]) if e >= 1] or [0]
            ranges.setdefault(col, []).extend(
                [min(data["q1"][i] for i in trained), max(data["q3"][i] for i in trained)]
            )
            for row, xkey in enumerate(("epoch", "time")):
                ax = axes[row][col]
                ax.plot(
                    data[xkey],
                    data["median"],
                    color=color,
                    marker="o",
                    markersize=3,
                    label=_label(s),
                )
                ax.fill_between(
                    data[xkey], data["q1"], data["q3"], color=color, alpha=0.2, linewidth=0
                )
    for col, (_, title) in enumerate(METRICS):
        for row, xlabel in enumerate(("epoch", "training wall-clock time [s]")):
            ax = axes[row][col]
            ax.set_title(title, fontsize=10)
            if ranges.get(col):
                lo, hi = min(ranges[col]), max(ranges[col])
                pad = 0.08 * (hi - lo) if hi > lo else 0.05 * max(abs(hi), 1e-3)
                ax.set_ylim(lo - pad, hi + pad)
            ax.set_xlabel(xlabel)
            ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(
            handles,
            labels,
            loc="lower center",
            ncols=min(4, len(handles)),
            fontsize=9,
            bbox_to_anchor=(0.5, 0.0),
            frameon=False,
        )
    banner = _banner(settings, synthetic)
    title = (
        f"{problem_title(problem)} - median and quartiles over seeds "
        "(y-axes fit to epochs >= 1; the initial point may lie outside)"
    )
    if varying:
        title += f"\nruns of one budget: {budget_label(budget, varying)}"
    fig.suptitle(
        title + ("\n" + banner if banner else ""),
        fontsize=11,
        color="firebrick" if banner else "black",
    )
    name = f"curves_{problem}" + ("_synthetic" if synthetic else "")
    name += (f"_{budget_slug(budget, varying)}" if varying else "") + ".png"
    return save(fig, Path(out_dir) / name)


def plot_curves(results_dir: str | Path, out_dir: str | Path) -> list[Path]:
    """One PNG per problem found below ``results_dir``; returns the written paths."""
    chosen = best_settings(load_runs(results_dir))
    varying = varying_budgets(chosen)
    return [
        plot_problem(p, syn, chosen[(p, syn, b)], Path(out_dir), b, varying.get((p, syn), []))
        for p, syn, b in ordered_keys(chosen)
    ]
