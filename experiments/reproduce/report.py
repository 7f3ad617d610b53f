"""The main job's figures and table, drawn by ``paper_figs`` from the result files.

This is the one module of ``experiments`` that imports ``paper_figs``: the main job sits above
both (``paper_figs`` itself only reads result files and never imports ``experiments``).
"""

from __future__ import annotations

import paper_figs

from ..problems import get_problem
from .plan import Plan


def budget_note(plan: Plan, synthetic: bool) -> str:
    if plan.full and not synthetic:
        return ""
    parts = []
    if synthetic:
        parts.append("**SYNTHETIC DATA** — random images and labels; these numbers mean nothing.")
    if not plan.full:
        parts.append(
            "**Budgeted run** (`python -m experiments reproduce` default): "
            + "; ".join(
                f"{p}: {b.epochs} of {get_problem(p).epochs} epochs on "
                + (f"{b.train_size:,}" if b.train_size else "all")
                + " training samples"
                + (f", evaluated on {b.eval_size:,} samples" if b.eval_size else "")
                + f", {plan.seeds[p]} seed(s)"
                for p, b in plan.budgets.items()
            )
            + "; fixed hyper-parameters instead of the paper's grid. "
            "Not comparable with the paper; `--full` runs its protocol."
        )
    return "\n\n".join(parts)


def make_outputs(plan: Plan, args, log) -> dict[str, list[str]]:
    """Curves, overhead chart and comparison table below ``args.out``; returns the paths."""
    figures = args.out / "figures"
    written: dict[str, list[str]] = {}
    runs_dir = args.out / "runs"
    written["curves"] = [str(p) for p in paper_figs.plot_curves(runs_dir, figures)]
    overhead_json = args.out / "overhead.json"
    if overhead_json.exists():
        written["overhead"] = [str(p) for p in paper_figs.plot_overhead(overhead_json, figures)]
    table = paper_figs.write_table(runs_dir, args.out, budget_note(plan, args.synthetic))
    written["table"] = [str(table)]
    return written
