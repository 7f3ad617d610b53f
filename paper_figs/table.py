"""Markdown table: our final test accuracies next to the BackPACK paper's.

    python -m paper_figs.table RESULTS_DIR OUT_DIR       # writes OUT_DIR/comparison.md

For every problem and optimizer the paper reports, and every one we ran, a row with the paper's
final test accuracy and ours (median and quartiles over seeds of the last epoch's test
accuracy; when a folder holds a grid, the setting whose search run has the best final
validation accuracy, as ``experiments.runner.grid`` chooses). A row is only *comparable* when
it ran the paper's protocol on real data: all epochs, the whole training set, the whole test
set, the paper's batch size. Budgeted runs (fewer
epochs, a training subset, a test subset) and synthetic data are marked as not comparable, and
the reason is given.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from .common import (
    Setting,
    best_settings,
    budget_label,
    load_runs,
    optimizer_title,
    ordered_keys,
    ordered_optimizers,
    problem_title,
    quantiles,
    varying_budgets,
)

#: Final test accuracies of Dangel, Kunstner & Hennig, "BackPACK: Packing more into backprop",
#: ICLR 2020 (DeepOBS problems, best grid setting, 10 seeds). MNIST logistic regression: every
#: method ends between 0.925 and 0.927.
MNIST_LOGREG_RANGE = (0.925, 0.927)
PAPER_TEST_ACC: dict[str, dict[str, float | tuple[float, float]]] = {
    "mnist_logreg": {
        opt: MNIST_LOGREG_RANGE
        for opt in ("momentum", "adam", "diagggn", "diagggn_mc", "kfac", "kflr")
    },
    "fmnist_2c2d": {
        "kfac": 0.926,
        "kflr": 0.926,
        "diagggn": 0.924,
        "diagggn_mc": 0.923,
        "adam": 0.923,
        "momentum": 0.922,
    },
    "cifar10_3c3d": {
        "kfac": 0.851,
        "kflr": 0.850,
        "diagggn_mc": 0.837,
        "adam": 0.834,
        "momentum": 0.834,
        "diagggn": 0.824,
    },
    "cifar100_allcnnc": {
        "kfac": 0.612,
        "momentum": 0.600,
        "diagggn_mc": 0.576,
        "adam": 0.561,
    },
}
PAPER_CITATION = "Dangel, Kunstner & Hennig, BackPACK: Packing more into backprop, ICLR 2020"


def paper_value(problem: str, optimizer: str):
    if problem == "mnist_logreg" and optimizer in ("kfra",):
        return MNIST_LOGREG_RANGE  # the paper: "every method" on MNIST logreg
    return PAPER_TEST_ACC.get(problem, {}).get(optimizer)


def _fmt_paper(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, tuple):
        return f"{v[0]:.3f}–{v[1]:.3f}"
    return f"{v:.3f}"


def _mid(v):
    if v is None:
        return None
    return sum(v) / 2 if isinstance(v, tuple) else v


def comparison_rows(results_dir: str | Path) -> list[dict]:
    """One dict per (problem, data kind, optimizer): paper value, ours, and comparability."""
    chosen = best_settings(load_runs(results_dir))
    rows = []
    real_problems = {p for p, syn, _ in chosen if not syn}
    keys = list(chosen) + [(p, False, ()) for p in PAPER_TEST_ACC if p not in real_problems]
    varying = varying_budgets(chosen)
    for problem, synthetic, budget in ordered_keys(set(keys)):
        ours = chosen.get((problem, synthetic, budget), {})
        varied = varying.get((problem, synthetic))
        # the paper's other optimizers as "not run", unless the rows are split by budget
        papers = set(PAPER_TEST_ACC.get(problem, {})) if not (synthetic or varied) else set()
        for opt in ordered_optimizers(set(ours) | papers):
            row = _row(problem, synthetic, opt, ours.get(opt))
            row["budget"] = budget_label(budget, varied) if varied else None
            rows.append(row)
    return rows


def _row(problem: str, synthetic: bool, opt: str, s: Setting | None) -> dict:
    paper = paper_value(problem, opt)
    row = {
        "problem": problem,
        "optimizer": opt,
        "synthetic": synthetic,
        "paper": paper,
        "ours": None,
        "q1": None,
        "q3": None,
        "seeds": 0,
        "lr": None,
        "damping": None,
        "notes": [],
        "comparable": False,
        "status": "not run",
    }
    if s is None:
        return row
    q1, med, q3 = quantiles(s.finals("test_acc"))
    statuses = [r.get("status", "?") for r in s.runs]
    notes = s.budget()
    if synthetic:
        notes = ["SYNTHETIC data (random images and labels)"] + notes
    diverged = sum(st != "finished" for st in statuses)
    row.update(
        ours=None if math.isnan(med) else med,
        q1=None if math.isnan(q1) else q1,
        q3=None if math.isnan(q3) else q3,
        seeds=len(s.runs),
        lr=s.config.get("lr"),
        damping=s.config.get("damping"),
        epochs=s.config.get("epochs"),
        notes=notes,
        comparable=not notes and paper is not None,
        status="finished" if not diverged else f"{diverged} of {len(statuses)} diverged",
    )
    return row


def _fmt_ours(row: dict) -> str:
    if row["ours"] is None:
        return "not run" if row["status"] == "not run" else "—"
    text = f"{row['ours']:.3f}"
    if row["seeds"] > 1 and row["q1"] is not None:
        text += f" [{row['q1']:.3f}, {row['q3']:.3f}]"
    if not row["comparable"]:
        text += " ⚠" if not row["synthetic"] else " ⚠ SYNTHETIC"
    return text


def _fmt_comparable(row: dict) -> str:
    if row["status"] == "not run":
        return "—"
    if row["comparable"]:
        extra = f" ({row['seeds']} seeds; paper: 10)" if row["seeds"] < 10 else ""
        return "yes" + extra
    why = "; ".join(row["notes"]) if row["notes"] else "no paper value"
    return f"**no**: {why}"


def markdown(rows: list[dict], title_note: str = "") -> str:
    lines = [
        "# Final test accuracy: ours next to the BackPACK paper",
        "",
        f"Paper: {PAPER_CITATION} (best grid setting; MNIST logreg: every method "
        f"{MNIST_LOGREG_RANGE[0]:.3f}–{MNIST_LOGREG_RANGE[1]:.3f}).",
        "Ours: median [first quartile, third quartile] over seeds of the test accuracy after "
        "the last epoch; where several settings were run (a grid), the one with the best final "
        "validation accuracy of its search run (seed 0). Runs of different budgets (epochs, "
        "training subset, ...) are never pooled: a problem run with several budgets has one "
        "group of rows per budget, named in brackets.",
        "",
        "**⚠ = not comparable with the paper's number**: a *budgeted* run (fewer epochs, a subset "
        "of the training or test set, another batch size) or *SYNTHETIC* data (random images and "
        "labels; chance level). Only rows marked *comparable: yes* measure the same thing as the "
        "paper.",
    ]
    if title_note:
        lines += ["", title_note]
    lines += [
        "",
        "| problem | optimizer | paper | ours | Δ (ours − paper) | lr | damping | status "
        "| comparable? |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        problem = problem_title(row["problem"]) + (" (SYNTHETIC)" if row["synthetic"] else "")
        if row.get("budget"):
            problem += f" [{row['budget']}]"
        delta = "—"
        if row["comparable"] and row["ours"] is not None:
            delta = f"{row['ours'] - _mid(row['paper']):+.3f}"
        lr = "—" if row["lr"] is None else f"{row['lr']:g}"
        damping = "—" if row["damping"] is None else f"{row['damping']:g}"
        lines.append(
            f"| {problem} | {optimizer_title(row['optimizer'])} | {_fmt_paper(row['paper'])} | "
            f"{_fmt_ours(row)} | {delta} | {lr} | {damping} | {row['status']} | "
            f"{_fmt_comparable(row)} |"
        )
    return "\n".join(lines) + "\n"


def write_table(results_dir: str | Path, out_dir: str | Path, title_note: str = "") -> Path:
    """Write ``comparison.md`` into ``out_dir`` and return its path."""
    out = Path(out_dir) / "comparison.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown(comparison_rows(results_dir), title_note))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m paper_figs.table", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("results_dir", type=Path, help="folder with run JSONs (searched recursively)")
    p.add_argument("out_dir", type=Path)
    p.add_argument("--print", dest="show", action="store_true", help="also print the table")
    args = p.parse_args(argv)
    path = write_table(args.results_dir, args.out_dir)
    if args.show:
        print(path.read_text())
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
