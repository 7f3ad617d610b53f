"""Figure of ``python -m experiments compare``: how close each curvature approximation is to
the exact GGN, per layer.

    python -m paper_figs compare RESULTS_DIR OUT_DIR

Reads every compare JSON below ``RESULTS_DIR`` (``results/compare/<problem>.json``) and writes
``compare_<problem>.png`` (``_synthetic`` for random data) with four panels: heatmaps of the
relative Frobenius error and of the cosine between approximate and exact damped Newton
directions (approximation x layer, last checkpoint; n/a: undefined for that layer), the
median error over layers at each checkpoint, and the top eigenvalues of the exact block and of
each approximation for the largest layer block.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from .common import _json_files, _read, new_figure, problem_title, save

LABELS = {
    "diag_ggn_exact": "DiagGGN",
    "diag_ggn_mc": "DiagGGN-MC",
    "diag_hessian": "DiagHessian",
    "kfac": "KFAC",
    "kflr": "KFLR",
    "kfra": "KFRA",
    "ekfac": "EKFAC",
    "empirical_fisher": "emp. Fisher",
}
COLORS = {
    "diag_ggn_exact": "tab:green",
    "diag_ggn_mc": "tab:olive",
    "diag_hessian": "tab:cyan",
    "kfac": "tab:red",
    "kflr": "tab:purple",
    "kfra": "tab:brown",
    "ekfac": "tab:orange",
    "empirical_fisher": "tab:gray",
}


def is_compare(obj) -> bool:
    return isinstance(obj, dict) and obj.get("kind") == "compare" and bool(obj.get("checkpoints"))


def load_compares(results_dir: str | Path) -> list[dict]:
    """Every compare JSON below ``results_dir``."""
    return [obj for obj in map(_read, _json_files(results_dir)) if is_compare(obj)]


def _metric(layer: dict, approx: str, key: str) -> float:
    value = layer["approximations"].get(approx, {}).get(key)
    return math.nan if value is None else value


def _ink(image, value: float) -> str:
    """Black on a light cell of ``image``, white on a dark one (its colour's luminance)."""
    if not math.isfinite(value):
        return "black"
    red, green, blue, _ = image.cmap(image.norm(value))
    return "black" if 0.299 * red + 0.587 * green + 0.114 * blue > 0.5 else "white"


def _heatmap(ax, fig, layers, approxs, key, title, vmin, vmax, cmap):
    grid = [[_metric(layer, a, key) for layer in layers] for a in approxs]
    image = ax.imshow(grid, vmin=vmin, vmax=vmax, cmap=cmap, aspect="auto")
    ax.set_xticks(range(len(layers)), [layer["name"] for layer in layers], rotation=45, ha="right")
    ax.set_yticks(range(len(approxs)), [LABELS.get(a, a) for a in approxs])
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            text = f"{value:.2f}" if math.isfinite(value) else "n/a"
            ax.text(j, i, text, ha="center", va="center", fontsize=7, color=_ink(image, value))
    ax.set_title(title, fontsize=9)
    fig.colorbar(image, ax=ax, fraction=0.04)


def plot_compare(results_dir, out_dir) -> list[Path]:
    """One figure per compare JSON; returns the written paths."""
    paths = []
    for result in load_compares(results_dir):
        checkpoints = result["checkpoints"]
        last = checkpoints[-1]
        layers = last["layers"]
        approxs = [a for a in LABELS if a in layers[0]["approximations"]]
        fig = new_figure(13, 8)
        fig.subplots_adjust(left=0.1, right=0.97, bottom=0.12, top=0.9, hspace=0.55, wspace=0.3)
        axes = fig.subplots(2, 2)
        _heatmap(
            axes[0, 0],
            fig,
            layers,
            approxs,
            "rel_frobenius",
            f"‖C − G‖_F / ‖G‖_F per layer block (epoch {last['epoch']})",
            0,
            1.0,
            "viridis_r",
        )
        _heatmap(
            axes[0, 1],
            fig,
            layers,
            approxs,
            "cosine",
            f"cos(Newton direction of C, of G), λ = {result['config']['damping']:g}",
            0,
            1.0,
            "viridis",
        )
        ax = axes[1, 0]
        epochs = [c["epoch"] for c in checkpoints]
        for a in approxs:
            medians = []
            for c in checkpoints:
                values = [_metric(layer, a, "rel_frobenius") for layer in c["layers"]]
                values = [v for v in values if math.isfinite(v)]
                medians.append(statistics.median(values) if values else math.nan)
            if any(math.isfinite(m) for m in medians):
                ax.plot(epochs, medians, "o-", color=COLORS.get(a), label=LABELS.get(a, a))
        ax.set_xlabel("epoch")
        ax.set_ylabel("median rel. Frobenius error over layers")
        ax.set_xticks(epochs)
        ax.legend(fontsize=7)
        ax = axes[1, 1]
        biggest = max(layers, key=lambda layer: layer["block"][0] * layer["block"][1])
        exact = biggest["exact_top_eigenvalues"]
        ax.semilogy(range(1, len(exact) + 1), exact, "k-", lw=2.5, label="exact GGN")
        for a in approxs:
            values = biggest["approximations"][a].get("top_eigenvalues")
            if values:
                ax.semilogy(
                    range(1, len(values) + 1),
                    values,
                    ".--",
                    color=COLORS.get(a),
                    label=LABELS.get(a, a),
                )
        block = "x".join(map(str, biggest["block"]))
        ax.set_title(f"top eigenvalues, {biggest['name']} (block {block})", fontsize=9)
        ax.set_xlabel("index")
        ax.legend(fontsize=7)
        synthetic = " [SYNTHETIC DATA]" if result["synthetic"] else ""
        fig.suptitle(
            f"{problem_title(result['problem'])}: curvature approximations vs the exact GGN"
            f"{synthetic}"
        )
        name = f"compare_{result['problem']}{'_synthetic' if result['synthetic'] else ''}.png"
        paths.append(save(fig, Path(out_dir) / name))
    return paths
