"""Shared pieces of the figure scripts: finding result files, grouping runs, labels, budgets.

Result files are the JSONs that ``experiments.runner.run`` writes (one per training run) and the
JSON of ``python -m experiments overhead --json``. Both are found recursively below a results
directory; anything else (grid summaries, checkpoints, unrelated JSON) is skipped.
"""

from __future__ import annotations

import sys

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

# --- names and colours ----------------------------------------------------------------------------

PROBLEM_TITLES = {
    "mnist_logreg": "MNIST logistic regression",
    "fmnist_2c2d": "Fashion-MNIST 2C2D",
    "fmnist_vit": "Fashion-MNIST ViT",
    "cifar10_3c3d": "CIFAR-10 3C3D",
    "cifar100_allcnnc": "CIFAR-100 All-CNN-C",
    "fortunes_gpt": "fortunes char-level GPT",
    "mnist_autoencoder": "MNIST autoencoder",
}
#: the metric of a problem whose metric is not the test accuracy (lower is better for these)
PROBLEM_METRICS = {
    "fortunes_gpt": "validation bits/char",
    "mnist_autoencoder": "test squared error",
}
OPTIMIZER_TITLES = {
    "momentum": "Momentum",
    "adam": "Adam",
    "diagggn": "DiagGGN",
    "diagggn_mc": "DiagGGN-MC",
    "kfac": "KFAC",
    "kflr": "KFLR",
    "kfra": "KFRA",
    "vsgd": "M-SVAG",
    "ekfac": "EKFAC",
    "soap": "SOAP",
    "psgd_kron": "PSGD-Kron",
    "sf_adamw": "schedule-free AdamW",
    "sf_kfac": "schedule-free KFAC",
    "muon": "Muon (torch) + AdamW",
    "muon_adamw": "MuonAdamW (heavyball)",
    "klsoap": "KL-SOAP",
    "eigen_adam": "EigenAdam",
    "kfac_ns": "KFAC + Newton-Schulz",
}
#: fixed colour per optimizer, so that the same method has the same colour in every figure
OPTIMIZER_COLORS = {
    "momentum": "tab:blue",
    "adam": "tab:orange",
    "diagggn": "tab:green",
    "diagggn_mc": "tab:olive",
    "kfac": "tab:red",
    "kflr": "tab:purple",
    "kfra": "tab:brown",
    "vsgd": "tab:gray",
    "ekfac": "tab:pink",
    "soap": "tab:cyan",
    "psgd_kron": "darkgoldenrod",
    "sf_adamw": "darkslateblue",
    "sf_kfac": "black",
    "muon": "tab:green",
    "muon_adamw": "yellowgreen",
    "klsoap": "teal",
    "eigen_adam": "tab:brown",
    "kfac_ns": "magenta",
}
OPTIMIZER_ORDER = list(OPTIMIZER_TITLES)
PROBLEM_ORDER = list(PROBLEM_TITLES)


def problem_title(name: str) -> str:
    return PROBLEM_TITLES.get(name, name)


def problem_metric(name: str) -> str:
    return PROBLEM_METRICS.get(name, "test accuracy")


def optimizer_title(name: str) -> str:
    return OPTIMIZER_TITLES.get(name, name)


def optimizer_color(name: str) -> str:
    return OPTIMIZER_COLORS.get(name, "black")


def _order(keys, preferred):
    rank = {k: i for i, k in enumerate(preferred)}
    return sorted(keys, key=lambda k: (rank.get(k, len(rank)), str(k)))


# --- reading result files -------------------------------------------------------------------------


def _json_files(results_dir: str | Path):
    root = Path(results_dir)
    if root.is_file():
        yield root
        return
    for path in sorted(root.rglob("*.json")):
        if path.name.endswith(".tmp"):
            continue
        yield path


def _read(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def is_run(obj) -> bool:
    return (
        isinstance(obj, dict)
        and isinstance(obj.get("config"), dict)
        and isinstance(obj.get("history"), list)
        and bool(obj["history"])
    )


def is_overhead(obj) -> bool:
    return (
        isinstance(obj, dict)
        and isinstance(obj.get("results"), list)
        and all(isinstance(r, dict) and "ratio_median" in r for r in obj["results"])
        and bool(obj["results"])
    )


def load_runs(results_dir: str | Path) -> list[dict]:
    """Every run JSON below ``results_dir``, with its path under ``"_path"``."""
    runs = []
    for path in _json_files(results_dir):
        obj = _read(path)
        if is_run(obj):
            obj["_path"] = str(path)
            runs.append(obj)
    return runs


def load_overheads(results_dir: str | Path) -> list[dict]:
    """Every overhead JSON below ``results_dir`` (``python -m experiments overhead --json``)."""
    found = []
    for path in _json_files(results_dir):
        obj = _read(path)
        if is_overhead(obj):
            obj["_path"] = str(path)
            found.append(obj)
    return found


# --- budgets: is a run the paper's protocol or a reduced one? -------------------------------------


#: The paper's protocol per problem (DeepOBS): epochs, batch size, augmentation, and the sizes of
#: the training split (10,000 images held out for validation) and of the test set. Reference
#: data, like the paper's accuracies in :mod:`paper_figs.table`.
PAPER_PROTOCOL = {
    "mnist_logreg": {
        "epochs": 50,
        "batch_size": 128,
        "augment": False,
        "train_samples": 50_000,
        "test_samples": 10_000,
    },
    "fmnist_2c2d": {
        "epochs": 100,
        "batch_size": 128,
        "augment": False,
        "train_samples": 50_000,
        "test_samples": 10_000,
    },
    "cifar10_3c3d": {
        "epochs": 100,
        "batch_size": 128,
        "augment": True,
        "train_samples": 40_000,
        "test_samples": 10_000,
    },
    "cifar100_allcnnc": {
        "epochs": 350,
        "batch_size": 256,
        "augment": True,
        "train_samples": 40_000,
        "test_samples": 10_000,
    },
}


def budget_notes(run: dict) -> list[str]:
    """Ways in which ``run`` deviates from the paper's protocol (empty: full protocol)."""
    cfg = run["config"]
    notes = []
    ref = PAPER_PROTOCOL.get(cfg["problem"])
    if ref is None:
        return ["unknown problem"]
    if cfg.get("epochs") is not None and cfg["epochs"] < ref["epochs"]:
        notes.append(f"{cfg['epochs']} of {ref['epochs']} epochs")
    prob = run.get("problem", {})
    train_n = prob.get("train_samples")
    train_n = train_n if train_n is not None else cfg.get("train_size")
    if train_n is not None and train_n < ref["train_samples"]:
        notes.append(f"{train_n:,} of {ref['train_samples']:,} training samples")
    test_n = prob.get("test_samples")
    test_n = test_n if test_n is not None else cfg.get("eval_size")
    if test_n is not None and test_n < ref["test_samples"]:
        notes.append(f"test on {test_n:,} of {ref['test_samples']:,} samples")
    if cfg.get("batch_size") not in (None, ref["batch_size"]):
        notes.append(f"batch size {cfg['batch_size']} (paper {ref['batch_size']})")
    if cfg.get("augment") is not None and bool(cfg["augment"]) != ref["augment"]:
        notes.append("augmentation " + ("on" if cfg["augment"] else "off"))
    if run.get("status") not in (None, "finished"):
        notes.append(f"status {run.get('status')}")
    return notes


def is_synthetic(run: dict) -> bool:
    return bool(run.get("synthetic") or run["config"].get("synthetic"))


# --- grouping runs into (problem, data, budget) -> optimizer -> setting -> seeds ------------------

#: what two runs must share to be drawn in one figure or compared in one table section
_BUDGET_KEYS = ("epochs", "batch_size", "train_size", "eval_size", "valid_size", "augment")


def budget_of(run: dict) -> tuple:
    """The run's budget as ``((key, value), ...)`` over ``_BUDGET_KEYS``."""
    cfg = run["config"]
    return tuple((k, cfg.get(k)) for k in _BUDGET_KEYS)


def _budget_value(key: str, value) -> str:
    """A budget value as text; unset sizes mean the whole set."""
    if value is None:
        return "all" if key.endswith("_size") else "default"
    return str(value)


def budget_label(budget: tuple, keys) -> str:
    """``train_size 5120, eval_size all`` (``budget``'s values of ``keys``)."""
    return ", ".join(f"{k} {_budget_value(k, v)}" for k, v in budget if k in keys)


def budget_slug(budget: tuple, keys) -> str:
    """A file-name part: ``train5120_evalall``."""
    short = {
        "batch_size": "batch",
        "train_size": "train",
        "eval_size": "eval",
        "valid_size": "valid",
    }
    return "_".join(f"{short.get(k, k)}{_budget_value(k, v)}" for k, v in budget if k in keys)


def varying_budgets(keys) -> dict[tuple[str, bool], list[str]]:
    """For each (problem, synthetic) that occurs with several budgets among the
    ``(problem, synthetic, budget)`` ``keys``: the budget keys whose values differ."""
    seen: dict[tuple[str, bool], set] = {}
    for problem, synthetic, budget in keys:
        seen.setdefault((problem, synthetic), set()).add(budget)
    return {
        k: [name for i, name in enumerate(_BUDGET_KEYS) if len({b[i] for b in budgets}) > 1]
        for k, budgets in seen.items()
        if len(budgets) > 1
    }


_SETTING_KEYS = (
    "lr",
    "damping",
    "epochs",
    "batch_size",
    "train_size",
    "eval_size",
    "valid_size",
    "augment",
    "synthetic",
)


@dataclass
class Setting:
    """The runs (seeds) of one optimizer with one hyper-parameter setting on one problem."""

    problem: str
    optimizer: str
    config: dict
    runs: list[dict] = field(default_factory=list)

    @property
    def synthetic(self) -> bool:
        return any(is_synthetic(r) for r in self.runs)

    def finals(self, key: str) -> list[float]:
        return [r["final"][key] for r in self.runs if r["final"].get(key) is not None]

    def score(self) -> float:
        """Final validation accuracy of the run with the lowest seed, the one a grid search
        ran (``experiments.runner.grid`` picks by it, then reruns more seeds); -1 if that run
        diverged."""
        first = min(self.runs, key=lambda r: r["config"].get("seed", 0))
        acc = first["final"].get("valid_acc")
        return -1.0 if first.get("status") != "finished" or acc is None else float(acc)

    @property
    def seeds(self) -> list[int]:
        return sorted(r["config"].get("seed", 0) for r in self.runs)

    def budget(self) -> list[str]:
        return budget_notes(self.runs[0]) if self.runs else []


def group_settings(
    runs: list[dict],
) -> dict[tuple[str, bool, tuple], dict[str, list[Setting]]]:
    """``{(problem, synthetic, budget): {optimizer: [Setting, ...]}}``: runs of different
    budgets (epochs, training subset, ...) are never mixed in one curve or one table row."""
    out: dict[tuple[str, bool, tuple], dict[str, dict[tuple, Setting]]] = {}
    for r in runs:
        cfg = r["config"]
        key = (cfg["problem"], is_synthetic(r), budget_of(r))
        setting = tuple(cfg.get(k) for k in _SETTING_KEYS)
        by_opt = out.setdefault(key, {}).setdefault(cfg["optimizer"], {})
        s = by_opt.setdefault(setting, Setting(cfg["problem"], cfg["optimizer"], dict(cfg)))
        seeds = {x["config"].get("seed") for x in s.runs}
        if cfg.get("seed") not in seeds:  # the same run found twice (copies) counts once
            s.runs.append(r)
    return {
        key: {opt: list(settings.values()) for opt, settings in by_opt.items()}
        for key, by_opt in out.items()
    }


def best_settings(runs: list[dict]) -> dict[tuple[str, bool, tuple], dict[str, Setting]]:
    """Per problem, data kind, budget and optimizer, the setting with the best final validation
    accuracy of its lowest-seed run (the paper's selection rule, as ``experiments.runner.grid``
    applies it); ties go to the setting with more seeds (the grid's rerun)."""
    chosen = {}
    for key, by_opt in group_settings(runs).items():
        chosen[key] = {
            opt: max(settings, key=lambda s: (s.score(), len(s.runs)))
            for opt, settings in by_opt.items()
        }
    return chosen


def ordered_keys(keys):
    """(problem, synthetic[, budget]) keys: the paper's problem order, real data first, then
    the budgets in a fixed order."""
    rank = {p: i for i, p in enumerate(PROBLEM_ORDER)}
    return sorted(keys, key=lambda k: (rank.get(k[0], len(rank)), k[0], k[1], str(k[2:])))


def ordered_optimizers(names):
    return _order(names, OPTIMIZER_ORDER)


# --- small numeric helpers ------------------------------------------------------------------------


def quantiles(values: list[float]) -> tuple[float, float, float]:
    """(q1, median, q3) with linear interpolation; NaN for no values."""
    vals = sorted(v for v in values if v is not None and math.isfinite(v))
    if not vals:
        return (math.nan, math.nan, math.nan)
    if len(vals) == 1:
        return (vals[0], vals[0], vals[0])

    def q(p):
        pos = p * (len(vals) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(vals) - 1)
        return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)

    return (q(0.25), q(0.5), q(0.75))


# --- figures without pyplot (no global backend state; Agg canvas) ---------------------------------


def new_figure(width: float, height: float) -> Figure:
    """A figure on an Agg canvas; margins are set by the caller (``subplots_adjust``), which
    draws several times faster than the constrained layout engine."""
    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def save(fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def draw_main(draw, results_dir, out_dir) -> int:
    """Run one figure function as a command: print the written paths, 1 when none."""
    paths = draw(results_dir, out_dir)
    if not paths:
        print(f"nothing to draw: no matching JSON below {results_dir}", file=sys.stderr)
        return 1
    for path in paths:
        print(path)
    return 0
