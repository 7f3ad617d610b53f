"""The time-to-result benchmark on tiny learnable data: clock, target, tuning, summaries."""

import json
import time

import pytest
import torch

import paper_figs
from experiments import ttr
from experiments.__main__ import main
from experiments.config import RunConfig
from experiments.data import ImageData, make_splits
from experiments.ttr import TtrProblem, train_to_target, tune_and_run
from experiments.ttr_report import markdown_table, quartiles, summarize


@pytest.fixture(scope="module")
def splits():
    """MNIST-shaped images whose label is a bright band at row 2*label: learnable in a few steps."""
    gen = torch.Generator().manual_seed(0)

    def draw(n):
        y = torch.randint(0, 10, (n,), generator=gen)
        x = torch.randint(0, 60, (n, 1, 28, 28), generator=gen, dtype=torch.uint8)
        for i, label in enumerate(y.tolist()):
            x[i, 0, 2 * label : 2 * label + 4, 4:24] = 255
        return x, y

    (train_x, train_y), (test_x, test_y) = draw(600), draw(100)
    data = ImageData("mnist", train_x, train_y, test_x, test_y, 10)
    return make_splits(data, valid_size=100, eval_size=100)


def _cfg(optimizer="adam", lr=0.01, damping=None, **kw):
    return RunConfig("mnist_logreg", optimizer, lr, damping=damping, batch_size=32, **kw)


def test_reachable_target_is_timed_at_the_first_evaluation_and_stops(splits):
    spec = TtrProblem(target=0.0, time_cap_s=5.0, eval_every_s=0.01, eval_size=100)
    row = train_to_target(_cfg(), spec, splits, stop_at_target=True)
    assert row["status"] == "reached" and len(row["curve"]) == 1
    assert row["time_to_target"] == pytest.approx(row["train_s"])
    assert row["curve"][0][0] == pytest.approx(row["train_s"], abs=1e-3)
    assert row["train_s"] < spec.time_cap_s


def test_unreachable_target_runs_to_the_cap(splits):
    spec = TtrProblem(target=1.01, time_cap_s=0.3, eval_every_s=0.1, eval_size=100)
    row = train_to_target(_cfg(), spec, splits, stop_at_target=True)
    assert row["status"] == "not reached" and row["time_to_target"] is None
    assert row["train_s"] >= spec.time_cap_s
    assert row["curve"][-1][0] == pytest.approx(row["train_s"], abs=1e-3)
    times = [t for t, _ in row["curve"]]
    assert times == sorted(times) and len(times) >= 3


def test_evaluation_time_is_not_on_the_training_clock(splits, monkeypatch):
    original = ttr.split_sums

    def slow(*args):
        time.sleep(0.05)
        return original(*args)

    monkeypatch.setattr(ttr, "split_sums", slow)
    spec = TtrProblem(target=1.01, time_cap_s=0.2, eval_every_s=0.02, eval_size=100)
    row = train_to_target(_cfg(), spec, splits, stop_at_target=False)
    evals = len(row["curve"])
    assert evals >= 5 and row["eval_s"] >= 0.05 * evals
    phases = row["per_step_s"]
    # the training clock is the sum of the step phases: no evaluation in it
    assert sum(phases.values()) * row["steps"] == pytest.approx(row["train_s"], rel=1e-6)


def test_curvature_optimizer_with_preset_trains(splits):
    spec = TtrProblem(target=0.5, time_cap_s=3.0, eval_every_s=0.05, eval_size=100)
    cfg = _cfg("kfac", 0.01, 0.1, preset="practical")
    row = train_to_target(cfg, spec, splits, stop_at_target=True)
    assert row["status"] == "reached" and row["valid_acc"] > 0.5


def test_tuning_picks_the_best_validation_accuracy_then_seeds_stop_at_target(splits, monkeypatch):
    calls = []

    def fake(cfg, spec, splits, stop_at_target):
        calls.append((cfg.lr, cfg.seed, stop_at_target))
        valid = {0.1: 0.5, 0.2: 0.9, 0.3: None}[cfg.lr]
        return {
            "seed": cfg.seed,
            "lr": cfg.lr,
            "damping": cfg.damping,
            "valid_acc": valid,
            "target": spec.target,
            "time_to_target": None,
            "status": "x",
            "steps": 1,
            "train_s": 1.0,
            "eval_s": 0.0,
        }

    monkeypatch.setattr(ttr, "train_to_target", fake)
    spec = TtrProblem(target=0.5, time_cap_s=1.0, eval_every_s=0.5)
    grid = ((0.1, None), (0.2, None), (0.3, None))
    search, rows = tune_and_run("mnist_logreg", "adam", None, spec, splits, grid, 3, log=len)
    assert calls == [
        (0.1, 0, False),
        (0.2, 0, False),
        (0.3, 0, False),
        (0.2, 1, True),
        (0.2, 2, True),
    ]
    assert [r["seed"] for r in rows] == [0, 1, 2] and {r["lr"] for r in rows} == {0.2}
    assert rows[0] is search[1] and all(r["problem"] == "mnist_logreg" for r in search + rows)


def test_quartiles_count_not_reached_as_infinite():
    assert quartiles([3.0, 1.0, 2.0]) == (1.5, 2.0, 2.5)
    assert quartiles([1.0, 2.0, None]) == (1.5, 2.0, None)
    assert quartiles([None, None, 1.0]) == (None, None, None)
    assert quartiles([4.0]) == (4.0, 4.0, 4.0)


def test_summary_table_per_optimizer_and_preset():
    def row(opt, preset, seed, t):
        return {
            "problem": "p",
            "optimizer": opt,
            "preset": preset,
            "seed": seed,
            "lr": 0.1,
            "damping": None,
            "target": 0.9,
            "time_to_target": t,
            "eval_s": 1.0,
            "per_step_s": {"forward_s": 0.1, "backward_s": 0.2, "step_s": 0.3},
        }

    rows = [row("kfac", "paper", s, t) for s, t in enumerate((1.0, None, 3.0))]
    rows += [row("kfac", "practical", s, None) for s in range(3)]
    table = summarize(rows)
    assert [(e["preset"], e["reached"], e["median_s"]) for e in table] == [
        ("paper", 2, 3.0),
        ("practical", 0, None),
    ]
    text = markdown_table(table)
    assert "| kfac | practical |" in text and "not reached [not reached" in text


def test_cli_writes_rows_summary_and_the_figures_draw_them(tmp_path):
    out = tmp_path / "results"
    args = [
        "ttr",
        "--synthetic",
        "--problems",
        "mnist_logreg",
        "--entries",
        "adam",
        "kfac:practical",
        "--seeds",
        "2",
        "--time-cap",
        "0.2",
        "--eval-every",
        "0.1",
        "--eval-size",
        "100",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    rows = json.loads((out / "ttr_rows.json").read_text())
    assert [(r["optimizer"], r["preset"], r["seed"]) for r in rows] == [
        ("adam", None, 0),
        ("adam", None, 1),
        ("kfac", "practical", 0),
        ("kfac", "practical", 1),
    ]
    for r in rows:
        assert {"problem", "target", "time_to_target"} <= set(r) and r["problem"] == "mnist_logreg"
    search = json.loads((out / "ttr_search.json").read_text())
    assert len(search) == 4  # two grid settings per entry, seed 0
    summary = json.loads((out / "ttr_summary.json").read_text())
    assert summary["meta"]["synthetic"] is True and summary["meta"]["threads"] == 1
    assert len(summary["table"]) == 2
    paths = paper_figs.plot_ttr(out, tmp_path / "figs")
    assert sorted(p.name for p in paths) == ["ttr_bars.png", "ttr_curves.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths)
    assert paper_figs.plot_ttr(tmp_path / "nothing", tmp_path / "figs") == []


def test_cli_rejects_unknown_entries(capsys):
    with pytest.raises(SystemExit):
        main(["ttr", "--entries", "adam:practical"])
    assert "unknown entry" in capsys.readouterr().err
