"""The benchmark's files and tables: entry JSONs, the cost JSON, the summary and its markdown.

A results folder (default ``experiments/results/ttr/``) holds

* ``<problem>_<optimizer>.json``: one optimizer's protocol on one problem (a new problem's
  calibration: ``<problem>_<optimizer>_calibration.json``)
  (:func:`experiments.ttr.protocol.tune_and_run`: its tuning runs, the winner, the winner's
  seeds) and ``meta`` (machine, threads, command);
* ``cost.json``: per problem, the interleaved cost per step of the winners
  (:func:`experiments.ttr.cost.measure_costs`) and ``meta`` (the CPU model it ran on, threads,
  command);
* ``summary.json`` and ``ttr.md``: the table (:func:`summarize`), and under it the CPU model
  that measured each problem's cost per step (:func:`machines_note`).

Files written before the batch size was tuned (settings without ``batch_size``) read as runs at
the problem's batch size. A calibration entry (a problem without targets yet) is not a row.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import replace
from pathlib import Path

from ..files import atomic_write, finite
from ..optimizers import OPTIMIZERS
from ..problems import get_problem
from .grids import Setting
from .protocol import target_key

COST, SUMMARY, TABLE = "cost.json", "summary.json", "ttr.md"
REFERENCE = "adam"
#: the optimizers curvopt provides; the others (torch's and other packages') are its peers
CURVOPT = frozenset(name for name, (cls, _) in OPTIMIZERS.items() if cls is not None)


def entry_path(folder: str | Path, problem: str, optimizer: str, calibration=False) -> Path:
    """``<problem>_<optimizer>.json``; a calibration entry (the targets' tuning of a new
    problem) ``<problem>_<optimizer>_calibration.json``, kept when the tuning to the targets
    writes the first."""
    suffix = "_calibration" if calibration else ""
    return Path(folder) / f"{problem}_{optimizer}{suffix}.json"


def write_json(path: Path, content) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(finite(content), indent=1, allow_nan=False)
    atomic_write(path, lambda p: p.write_text(text + "\n"))


def load_entries(folder: str | Path) -> list[dict]:
    """Every entry file of ``folder`` (sorted by name)."""
    skip = {COST, SUMMARY}
    out = []
    for path in sorted(Path(folder).glob("*.json")):
        if path.name not in skip:
            entry = json.loads(path.read_text())
            if {"problem", "optimizer", "runs"} <= set(entry):
                out.append(entry)
    return out


def load_costs(folder: str | Path) -> dict:
    path = Path(folder) / COST
    return json.loads(path.read_text()) if path.is_file() else {}


def median_steps(values: list[int | None]) -> float | None:
    """Median with not reached (``None``) as infinite; ``None`` when the median is infinite."""
    m = statistics.median(math.inf if v is None else v for v in values)
    return None if math.isinf(m) else m


def winner_setting(entry: dict) -> Setting:
    return Setting.from_dict(entry["tuning"][entry["winner"]]["setting"])


def batch_size(problem: str, setting: Setting) -> int | None:
    """The setting's batch size, else the problem's (``None`` for an unknown problem)."""
    if setting.batch_size is not None:
        return setting.batch_size
    try:
        return get_problem(problem).batch_size
    except ValueError:
        return None


def _same(problem: str, a: Setting, b: Setting) -> bool:
    """Equal settings, a batch size not written being the problem's."""
    return replace(a, batch_size=batch_size(problem, a)) == replace(
        b, batch_size=batch_size(problem, b)
    )


def summarize(entries: list[dict], costs: dict) -> list[dict]:
    """One row per (problem, optimizer): the winner, steps to each target (median and per
    seed), the interleaved cost per step (CPU time, and wall-clock; only where ``costs``
    measured this very setting), estimated seconds (median steps x CPU cost), the runs' own
    wall-clock to the highest target (median over seeds), both as ratios to tuned Adam, and the
    estimate as a ratio to the best peer's (:func:`best_peer`)."""
    rows = []
    for entry in entries:
        problem, optimizer = entry["problem"], entry["optimizer"]
        targets = entry["spec"]["targets"]
        if not targets:
            continue
        setting = winner_setting(entry)
        runs = entry["runs"]
        measurement = costs.get("problems", {}).get(problem, {})
        measured = measurement.get("entries", {}).get(optimizer)
        cost = cost_wall = machine = None
        if measured is not None and _same(problem, Setting.from_dict(measured["setting"]), setting):
            cost, cost_wall = measured["per_step_s"], measured["per_step_wall_s"]
            machine = measurement.get("meta", {}).get("machine")
        steps, per_seed, est = {}, {}, {}
        for t in targets:
            key = target_key(t)
            per_seed[key] = [r["steps_to"][key] for r in runs]
            steps[key] = median_steps(per_seed[key])
            est[key] = None if steps[key] is None or cost is None else steps[key] * cost
        top = target_key(targets[-1])
        wall = [r["seconds_to"][top] for r in runs]
        rows.append(
            {
                "problem": problem,
                "optimizer": optimizer,
                "setting": setting.as_dict(),
                "label": setting.label,
                "batch_size": batch_size(problem, setting),
                "compiled": _compiled(runs),
                "targets": targets,
                "seeds": [r["seed"] for r in runs],
                "steps": steps,
                "steps_per_seed": per_seed,
                "cost_per_step_s": cost,
                "cost_per_step_wall_s": cost_wall,
                "cost_machine": machine,
                "est_s": est,
                "wall_s": median_steps(wall),
                "wall_s_per_seed": wall,
                "tuning_steps": [
                    [Setting.from_dict(r["setting"]).label, r["steps_to"][top]]
                    for r in entry["tuning"]
                ],
            }
        )
    for row in rows:
        ref = next(
            (r for r in rows if r["problem"] == row["problem"] and r["optimizer"] == REFERENCE),
            None,
        )
        top = target_key(row["targets"][-1])
        row["est_ratio_to_adam"] = _ratio(row["est_s"][top], ref and ref["est_s"][top])
        row["wall_ratio_to_adam"] = _ratio(row["wall_s"], ref and ref["wall_s"])
        best = best_peer(rows, row["problem"])
        row["best_peer"] = best and best["optimizer"]
        row["est_ratio_to_best_peer"] = _ratio(row["est_s"][top], best and best["est_s"][top])
    return rows


def best_peer(rows: list[dict], problem: str) -> dict | None:
    """The row of ``problem``'s fastest peer (not one of :data:`CURVOPT`) by estimated time to
    the highest target, among those whose time is known."""
    peers = [
        r
        for r in rows
        if r["problem"] == problem
        and r["optimizer"] not in CURVOPT
        and r["est_s"][target_key(r["targets"][-1])] is not None
    ]
    return min(peers, key=lambda r: r["est_s"][target_key(r["targets"][-1])], default=None)


def _compiled(runs: list[dict]) -> bool | None:
    """Whether a peer's runs were compiled (``None``: not a compiling peer)."""
    infos = [r.get("compile") for r in runs if r.get("compile")]
    return all(i["compiled"] for i in infos) if infos else None


def _ratio(a, b):
    return None if a is None or not b else a / b


def _n(x, fmt="{:.0f}") -> str:
    return "not reached" if x is None else fmt.format(x)


def _ms(cpu, wall) -> str:
    return "-" if cpu is None else f"{1e3 * cpu:.1f} / {1e3 * wall:.1f}"


def _ratio_cell(value, ratio) -> str:
    """A ratio to Adam: ``-`` where this entry's value is unknown or Adam's is missing."""
    if value is None:
        return "-"
    return "-" if ratio is None else f"{ratio:.2f}"


def _peer_cell(row: dict, key: str) -> str:
    """The ratio to the best peer and its name (``1.41 (muon)``), ``-`` where unknown."""
    ratio = _ratio_cell(row["est_s"][key], row.get("est_ratio_to_best_peer"))
    return ratio if ratio == "-" else f"{ratio} ({row['best_peer']})"


def _title(row: dict) -> str:
    """The winning setting, and for a compiling peer whether it ran compiled."""
    compiled = row.get("compiled")
    return row["label"] + ("" if compiled is None else (", compiled" if compiled else ", eager"))


def markdown_table(rows: list[dict]) -> str:
    """The table: steps to each target (median; per seed), ms per step, estimated and measured
    seconds to the highest target, ratios to Adam and (estimated) to the best peer."""
    lines = [
        "| problem | optimizer (winning setting) | batch | target | steps (median) | "
        "steps per seed | ms/step (interleaved: CPU / wall) | est. s = steps × CPU cost | "
        "ratio to Adam (est.) | ratio to the best peer (est.) | "
        "wall-clock s of the runs (median) | ratio to Adam (wall) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for i, t in enumerate(r["targets"]):
            key = target_key(t)
            top = i == len(r["targets"]) - 1
            cost = r["cost_per_step_s"]
            seeds = ", ".join("-" if s is None else str(s) for s in r["steps_per_seed"][key])
            lines.append(
                f"| {r['problem']} | {_title(r)} | {r.get('batch_size') or '-'} | {key} | "
                f"{_n(r['steps'][key])} | {seeds} | "
                f"{_ms(cost, r['cost_per_step_wall_s'])} | "
                f"{'-' if cost is None else _n(r['est_s'][key], '{:.1f}')} | "
                f"{_ratio_cell(r['est_s'][key], r['est_ratio_to_adam']) if top else ''} | "
                f"{_peer_cell(r, key) if top else ''} | "
                f"{_n(r['wall_s'], '{:.1f}') if top else ''} | "
                f"{_ratio_cell(r['wall_s'], r['wall_ratio_to_adam']) if top else ''} |"
            )
    return "\n".join(lines)


def machines_note(rows: list[dict]) -> str:
    """One line per problem whose cost per step is known: the CPU model(s) that measured it
    (``cost_machine`` of its rows); ``""`` when no row has a cost."""
    machines: dict[str, list[str]] = {}
    for r in rows:
        if r.get("cost_machine"):
            seen = machines.setdefault(r["problem"], [])
            if r["cost_machine"] not in seen:
                seen.append(r["cost_machine"])
    return "\n".join(
        f"* {problem}: ms/step measured on {'; '.join(names)}"
        for problem, names in machines.items()
    )


def write_summary(folder: str | Path, meta: dict) -> tuple[list[dict], Path]:
    """Summarise ``folder``'s entries with its cost file into ``summary.json`` and ``ttr.md``
    (the table, then :func:`machines_note`)."""
    folder = Path(folder)
    rows = summarize(load_entries(folder), load_costs(folder))
    write_json(folder / SUMMARY, {"meta": meta, "table": rows})
    note = machines_note(rows)
    text = markdown_table(rows) + (f"\n\n{note}" if note else "")
    atomic_write(folder / TABLE, lambda p: p.write_text(text + "\n"))
    return rows, folder / SUMMARY
