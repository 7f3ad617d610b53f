"""paper_figs on tiny result files written here, and experiments.reproduce end to end on
synthetic data (no network, no real data)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import paper_figs
from experiments.data import SPECS
from experiments.problems import PROBLEMS
from paper_figs import common, curves, overhead, table
from paper_figs.__main__ import main as figs_main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run_json(
    problem="mnist_logreg",
    optimizer="momentum",
    seed=0,
    lr=0.1,
    damping=None,
    epochs=3,
    train_size=1000,
    eval_size=None,
    synthetic=False,
    final_test=0.9,
    valid=0.9,
    diverge_at=None,
    train_samples=None,
    test_samples=10_000,
    batch_size=None,
):
    """A run JSON shaped like experiments.runner's output."""
    history = []
    last = epochs if diverge_at is None else diverge_at - 1
    for e in range(last + 1):
        frac = e / max(1, epochs)
        history.append(
            {
                "epoch": e,
                "train_loss": 2.3 - frac + 0.01 * seed,
                "train_acc": 0.1 + 0.8 * frac,
                "valid_loss": 2.3 - frac,
                "valid_acc": 0.1 + (valid - 0.1) * frac,
                "test_loss": 2.3 - 0.9 * frac,
                "test_acc": 0.1 + (final_test - 0.1) * frac + 0.001 * seed,
                "time": {"eval_s": 0.1, **({"epoch_s": 1.0 + seed} if e else {})},
            }
        )
    cfg = {
        "problem": problem,
        "optimizer": optimizer,
        "lr": lr,
        "damping": damping,
        "seed": seed,
        "epochs": epochs,
        "batch_size": batch_size or (256 if problem == "cifar100_allcnnc" else 128),
        "train_size": train_size,
        "eval_size": eval_size,
        "valid_size": 10_000,
        "augment": problem.startswith("cifar"),
        "synthetic": synthetic,
    }
    return {
        "name": f"{problem}_{optimizer}_lr{lr:g}_seed{seed}",
        "status": "finished" if diverge_at is None else "diverged",
        "synthetic": synthetic,
        "config": cfg,
        "problem": {
            "train_samples": train_samples if train_samples is not None else (train_size or 50_000),
            "test_samples": test_samples,
        },
        "final": history[-1],
        "history": history,
        "timing": {"epoch_s": float(epochs)},
    }


def _write(folder: Path, obj: dict, name: str | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name or obj['name']}.json"
    path.write_text(json.dumps(obj))
    return path


def _overhead_json(backends=("curvopt",), batch=64):
    results = [
        {
            "problem": "3c3d",
            "quantity": "plain",
            "backend": "plain",
            "ratio_median": 1.0,
            "ratio_q1": 1.0,
            "ratio_q3": 1.0,
        }
    ]
    for i, q in enumerate(("hooks", "BatchGrad", "Variance", "DiagGGNMC", "KFAC")):
        for j, b in enumerate(backends):
            entry = {"problem": "3c3d", "quantity": q, "backend": b}
            if b == "backpack" and q == "hooks":
                entry.update(ratio_median=None, ratio_q1=None, ratio_q3=None, error="n/a: no")
            else:
                r = 1.0 + 0.3 * i + 0.1 * j
                entry.update(ratio_median=r, ratio_q1=r - 0.05, ratio_q3=r + 0.05, error=None)
            results.append(entry)
    return {
        "torch": "2.x",
        "threads": 2,
        "device": "cpu",
        "load_average_at_start": 1.0,
        "backends": list(backends),
        "problems": {"3c3d": {"description": f"DeepOBS 3C3D, N={batch}", "plain_ms": 120.0}},
        "results": results,
    }


@pytest.fixture
def results(tmp_path):
    """Two problems, two optimizers, two seeds; plus a synthetic problem, a worse lr setting
    (a grid), a diverged seed and an unrelated JSON."""
    runs = tmp_path / "results" / "runs"
    for seed in (0, 1):
        _write(runs, _run_json(seed=seed))
        _write(runs, _run_json(optimizer="kfac", lr=0.1, damping=0.01, seed=seed, final_test=0.91))
        _write(
            runs,
            _run_json(optimizer="kfac", lr=1.0, damping=0.01, seed=seed, valid=0.5, final_test=0.5),
        )
        _write(
            runs,
            _run_json(
                problem="fmnist_2c2d",
                optimizer="adam",
                lr=1e-3,
                seed=seed,
                epochs=2,
                train_size=384,
                eval_size=500,
                test_samples=500,
                diverge_at=2 if seed else None,
            ),
        )
        _write(runs, _run_json(problem="cifar10_3c3d", synthetic=True, seed=seed, final_test=0.1))
    _write(tmp_path / "results", {"something": "else"}, "unrelated")
    _write(tmp_path / "results", _overhead_json(("curvopt", "backpack")), "overhead")
    return tmp_path / "results"


def _by_problem(chosen: dict) -> dict:
    """``{(problem, synthetic): ...}`` of results with one budget per problem."""
    out = {}
    for problem, synthetic, _budget in chosen:
        assert (problem, synthetic) not in out, "several budgets"
        out[(problem, synthetic)] = chosen[(problem, synthetic, _budget)]
    return out


def _is_png(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 1000 and path.read_bytes()[:8] == PNG_MAGIC


def test_curves_one_png_per_problem(results, tmp_path):
    out = tmp_path / "figs"
    paths = paper_figs.plot_curves(results, out)
    names = sorted(p.name for p in paths)
    assert names == [
        "curves_cifar10_3c3d_synthetic.png",
        "curves_fmnist_2c2d.png",
        "curves_mnist_logreg.png",
    ]
    assert all(_is_png(p) for p in paths)


def test_curves_series_median_quartiles_and_dropouts(results):
    chosen = _by_problem(common.best_settings(common.load_runs(results)))
    s = chosen[("mnist_logreg", False)]["kfac"]
    assert s.config["lr"] == 0.1  # the better validation accuracy of the two kfac settings
    assert len(s.runs) == 2
    data = curves.series(s, "test_acc")
    assert data["epoch"] == [0, 1, 2, 3]
    assert data["q1"][-1] <= data["median"][-1] <= data["q3"][-1]
    assert data["median"][-1] == pytest.approx(0.9105)
    assert data["time"] == [0.0, 1.5, 3.0, 4.5]  # median of the seeds' cumulative epoch_s
    adam = chosen[("fmnist_2c2d", False)]["adam"]
    d = curves.series(adam, "test_acc")
    assert d["n"] == [2, 2, 1]  # the diverged seed stops after epoch 1


def test_overhead_png_with_backpack_side_by_side(results, tmp_path):
    paths = paper_figs.plot_overhead(results, tmp_path / "figs")
    assert [p.name for p in paths] == ["overhead.png"]
    assert _is_png(paths[0])
    panels = overhead.collect_panels(common.load_overheads(results))
    assert list(panels) == [("3c3d", 64)]
    assert ("KFAC", "backpack") in panels[("3c3d", 64)]["cells"]
    assert paper_figs.plot_overhead(tmp_path / "empty_dir_that_does_not_exist", tmp_path) == []


def test_overhead_single_file_and_several_batch_sizes(tmp_path):
    a = _write(tmp_path / "o", _overhead_json(batch=32), "o32")
    _write(tmp_path / "o", _overhead_json(batch=128), "o128")
    assert _is_png(paper_figs.plot_overhead(a, tmp_path / "f1")[0])
    panels = overhead.collect_panels(common.load_overheads(tmp_path / "o"))
    assert sorted(panels) == [("3c3d", 32), ("3c3d", 128)]
    assert _is_png(paper_figs.plot_overhead(tmp_path / "o", tmp_path / "f2")[0])


def test_table_has_the_papers_numbers_and_marks_budget_and_synthetic(results, tmp_path):
    path = paper_figs.write_table(results, tmp_path / "t", "note at the top")
    text = path.read_text()
    assert path.name == "comparison.md" and "note at the top" in text
    for number in (
        "0.925–0.927",
        "0.926",
        "0.924",
        "0.923",
        "0.922",
        "0.851",
        "0.850",
        "0.837",
        "0.834",
        "0.824",
        "0.612",
        "0.600",
        "0.576",
        "0.561",
    ):
        assert number in text, number
    rows = {
        (r["problem"], r["synthetic"], r["optimizer"]): r for r in table.comparison_rows(results)
    }
    kfac = rows[("mnist_logreg", False, "kfac")]
    assert kfac["ours"] == pytest.approx(0.9105) and kfac["seeds"] == 2 and kfac["lr"] == 0.1
    assert not kfac["comparable"]
    assert "3 of 50 epochs" in kfac["notes"] and "1,000 of 50,000 training samples" in kfac["notes"]
    adam = rows[("fmnist_2c2d", False, "adam")]
    assert "test on 500 of 10,000 samples" in adam["notes"]
    assert adam["status"] == "1 of 2 diverged"
    syn = rows[("cifar10_3c3d", True, "momentum")]
    assert not syn["comparable"] and "SYNTHETIC" in syn["notes"][0]
    assert rows[("cifar100_allcnnc", False, "kfac")]["status"] == "not run"
    lines = [line for line in text.splitlines() if line.startswith("| CIFAR-10 3C3D (SYNTHETIC)")]
    assert lines and all("⚠ SYNTHETIC" in line and "**no**" in line for line in lines)
    mnist = [
        line for line in text.splitlines() if line.startswith("| MNIST logistic regression | KFAC")
    ]
    assert "⚠" in mnist[0] and "**no**: 3 of 50 epochs" in mnist[0]


def test_table_full_protocol_run_is_comparable(tmp_path):
    runs = tmp_path / "r"
    for seed in range(10):
        _write(
            runs,
            _run_json(
                problem="fmnist_2c2d",
                optimizer="kfac",
                lr=0.01,
                damping=0.01,
                seed=seed,
                epochs=100,
                train_size=None,
                final_test=0.925,
            ),
        )
    row = [
        r
        for r in table.comparison_rows(runs)
        if r["optimizer"] == "kfac" and r["problem"] == "fmnist_2c2d"
    ][0]
    assert row["comparable"] and row["notes"] == []
    text = paper_figs.write_table(runs, tmp_path).read_text()
    line = [x for x in text.splitlines() if x.startswith("| Fashion-MNIST 2C2D | KFAC")][0]
    assert "| yes |" in line and "+0.00" in line and "⚠" not in line


def test_cli(tmp_path, capsys):
    results = tmp_path / "small"
    _write(results, _run_json(optimizer="adam", lr=0.01))
    _write(results, _overhead_json(), "overhead")
    out = tmp_path / "cli"
    assert figs_main(["all", str(results), str(out)]) == 0
    printed = capsys.readouterr().out
    assert "overhead.png" in printed and "comparison.md" in printed
    assert "curves_mnist_logreg.png" in printed
    assert (out / "comparison.md").exists() and _is_png(out / "overhead.png")
    assert figs_main(["curves", str(tmp_path / "nothing"), str(out)]) == 1
    assert overhead.main([str(tmp_path / "nothing"), str(out)]) == 1
    assert table.main([str(results), str(tmp_path / "t2")]) == 0
    assert (tmp_path / "t2" / "comparison.md").exists()


# --- experiments.reproduce ------------------------------------------------------------------


def test_reproduce_arguments_and_plans():
    from experiments import reproduce as rep

    args = rep.parse_args([])
    assert args.out == Path("results/reproduce") and not args.full
    plan = rep.make_plan(args)
    assert plan.problems == ["mnist_logreg", "fmnist_2c2d"]
    assert plan.optimizers["fmnist_2c2d"] == ["momentum", "adam", "diagggn_mc", "kfac"]
    assert plan.seeds == {"mnist_logreg": 3, "fmnist_2c2d": 3}
    assert plan.budgets["mnist_logreg"].epochs < 50
    cfgs = plan.configs("mnist_logreg", synthetic=False)
    assert len(cfgs) == 12 and {c.seed for c in cfgs} == {0, 1, 2}
    assert all(c.damping is None for c in cfgs if c.optimizer in ("momentum", "adam"))
    assert all(c.damping is not None for c in cfgs if c.optimizer in ("kfac", "diagggn_mc"))

    full = rep.make_plan(rep.parse_args(["--full"]))
    assert rep.parse_args(["--full"]).out == Path("results/reproduce_full")
    assert full.problems == ["mnist_logreg", "fmnist_2c2d", "cifar10_3c3d", "cifar100_allcnnc"]
    assert set(full.seeds.values()) == {10} and full.optimizers["cifar100_allcnnc"] == [
        "momentum",
        "adam",
        "diagggn_mc",
        "kfac",
    ]
    assert full.budgets["cifar100_allcnnc"] == rep.Budget(350, None, None, 10)

    custom = rep.make_plan(
        rep.parse_args(
            [
                "--problems",
                "mnist_logreg",
                "--optimizers",
                "adam",
                "--epochs",
                "1",
                "--train-size",
                "0",
                "--eval-size",
                "256",
                "--seeds",
                "3",
            ]
        )
    )
    assert custom.budgets["mnist_logreg"] == rep.Budget(1, None, 256, 3)
    assert custom.optimizers == {"mnist_logreg": ["adam"]} and custom.seeds == {"mnist_logreg": 3}
    for bad in (
        ["--seeds", "0"],
        ["--epochs", "0"],
        ["--train-size", "-1"],
        ["--problems", "imagenet"],
        ["--threads", "0"],
    ):
        with pytest.raises(SystemExit):
            rep.parse_args(bad)
    assert rep.choose_threads(3) == (3, "--threads")
    assert rep.choose_threads(None)[0] in (1, 2)


def test_reproduce_full_protocol_commands_and_dry_run(capsys):
    from experiments import reproduce as rep

    cmds = rep.full_protocol_commands("X")
    grids = [c for c in cmds if " grid " in c]
    assert len(grids) == sum(len(v) for v in rep.PAPER_OPTIMIZERS.values()) == 22
    # the curvature optimizers take the paper's update (preset paper: kl_clip=None)
    kfac = "python -m experiments grid cifar100_allcnnc kfac --preset paper --seeds 10"
    assert f"{kfac} --results-dir X/runs" in cmds
    assert (
        "python -m experiments grid mnist_logreg momentum --seeds 10 --results-dir X/runs" in cmds
    )
    assert rep.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "python -m experiments grid fmnist_2c2d kflr --preset paper --seeds 10" in out


def test_reproduce_registers_second_order_overhead_quantities():
    from experiments import reproduce as rep
    from experiments.overhead.cases import QUANTITIES

    before = set(QUANTITIES)
    try:
        added = rep.register_second_order(["DiagGGNMC", "KFAC", "NoSuchExtension"])
        assert added == ["DiagGGNMC", "KFAC"]
        assert QUANTITIES["KFAC"].order == 2 and QUANTITIES["KFAC"].attrs() == ("kfac",)
    finally:
        for name in set(QUANTITIES) - before:
            del QUANTITIES[name]


def test_reproduce_smoke_on_synthetic_data(tmp_path, capsys):
    from experiments import reproduce as rep

    out = tmp_path / "rep"
    argv = [
        "--synthetic",
        "--problems",
        "mnist_logreg",
        "--optimizers",
        "momentum",
        "kfac",
        "--epochs",
        "1",
        "--train-size",
        "128",
        "--eval-size",
        "128",
        "--seeds",
        "1",
        "--no-overhead",
        "--no-fetch",
        "--threads",
        "1",
        "--out",
        str(out),
    ]
    assert rep.main(argv) == 0
    printed = capsys.readouterr().out
    assert "SYNTHETIC" in printed and "python -m experiments reproduce --full" in printed
    assert _is_png(out / "figures" / "curves_mnist_logreg_synthetic.png")
    text = (out / "comparison.md").read_text()
    assert "⚠ SYNTHETIC" in text and "Budgeted run" in text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["runs"] == 2 and summary["synthetic"] and summary["wall_clock_s"] > 0
    assert len(list((out / "runs").glob("*_synthetic.json"))) == 2


def test_grid_selection_follows_the_search_run_like_runner_grid(tmp_path):
    """runner.grid picks by the seed-0 search run and reruns that setting with more seeds;
    the figures and table must show that setting, even if a later seed is worse."""
    runs = tmp_path / "grid"
    _write(runs, _run_json(lr=0.1, seed=0, valid=0.90, final_test=0.90))
    for seed in (1, 2):
        _write(runs, _run_json(lr=0.1, seed=seed, valid=0.50, final_test=0.50))
    _write(runs, _run_json(lr=1.0, seed=0, valid=0.85, final_test=0.85))
    _write(runs, _run_json(lr=0.01, seed=0, valid=0.95, final_test=0.95, diverge_at=2))
    chosen = _by_problem(common.best_settings(common.load_runs(runs)))
    chosen = chosen[("mnist_logreg", False)]["momentum"]
    assert chosen.config["lr"] == 0.1 and chosen.seeds == [0, 1, 2]


def test_paper_protocol_reference_matches_the_experiments_problems():
    """paper_figs keeps the paper's protocol as reference data (it never imports experiments)."""
    assert set(common.PAPER_PROTOCOL) == set(PROBLEMS) - {"fmnist_vit"}  # not the paper's
    for name, ref in common.PAPER_PROTOCOL.items():
        p = PROBLEMS[name]
        assert (ref["epochs"], ref["batch_size"], ref["augment"]) == (
            p.epochs,
            p.batch_size,
            p.augment,
        )
        train, test = SPECS[p.dataset].sizes
        assert (ref["train_samples"], ref["test_samples"]) == (train - 10_000, test)


def test_overhead_versus_backpack_geometric_mean(tmp_path):
    obj = _overhead_json(backends=("curvopt", "backpack"))
    for r, v in zip((r for r in obj["results"] if r["backend"] == "curvopt"), (0.5, 2.0, None)):
        r["versus_backpack"] = v
    panels = overhead.collect_panels([obj])
    mean, cells = overhead.versus_backpack(panels[("3c3d", 64)]["cells"])
    assert cells == 2 and mean == pytest.approx(1.0)
    assert (
        overhead.versus_backpack(overhead.collect_panels([_overhead_json()])[("3c3d", 64)]["cells"])
        is None
    )
    assert _is_png(paper_figs.plot_overhead(_write(tmp_path / "o", obj, "v"), tmp_path / "f")[0])


def test_runs_of_different_budgets_are_never_mixed(tmp_path):
    """The main job's 3-seed 1,024-sample KFAC runs and one 5,120-sample run of the README
    in one results folder: two figures and two groups of table rows, each of one budget (the
    single better run must not replace the three seeds)."""
    results = tmp_path / "results"
    small = dict(problem="fmnist_2c2d", optimizer="kfac", lr=0.1, damping=0.1, train_size=1024)
    for seed in range(3):
        _write(results / "reproduce", _run_json(**small, seed=seed, valid=0.6, final_test=0.6))
    _write(results / "reproduce", _run_json(problem="fmnist_2c2d", train_size=1024))
    big = _run_json(**{**small, "train_size": 5120}, valid=0.8, final_test=0.8)
    _write(results, big, name=big["name"] + "_5120")

    chosen = common.best_settings(common.load_runs(results))
    assert len(chosen) == 2
    by_train = {dict(b)["train_size"]: opts for (_, _, b), opts in chosen.items()}
    assert by_train[1024]["kfac"].seeds == [0, 1, 2] and by_train[5120]["kfac"].seeds == [0]
    assert "momentum" not in by_train[5120]

    names = sorted(p.name for p in paper_figs.plot_curves(results, tmp_path / "figs"))
    assert names == ["curves_fmnist_2c2d_train1024.png", "curves_fmnist_2c2d_train5120.png"]
    rows = [r for r in table.comparison_rows(results) if r["problem"] == "fmnist_2c2d"]
    kfac = {r["budget"]: r for r in rows if r["optimizer"] == "kfac"}
    assert set(kfac) == {"train_size 1024", "train_size 5120"}
    assert kfac["train_size 1024"]["seeds"] == 3 and kfac["train_size 5120"]["seeds"] == 1
    text = table.markdown(table.comparison_rows(results))
    assert "Fashion-MNIST 2C2D [train_size 5120]" in text

    budget = common.budget_of(_run_json(train_size=None, eval_size=500))
    keys = ["train_size", "eval_size", "augment"]
    assert common.budget_slug(budget, keys) == "trainall_eval500_augmentFalse"
    assert common.budget_label(budget, keys) == "train_size all, eval_size 500, augment False"

    alone = _by_problem(common.best_settings(common.load_runs(results / "reproduce")))
    assert alone[("fmnist_2c2d", False)]["kfac"].seeds == [0, 1, 2]
    assert [p.name for p in paper_figs.plot_curves(results / "reproduce", tmp_path / "f2")] == [
        "curves_fmnist_2c2d.png"  # one budget: the name stays as before
    ]


def test_ttr_figure_of_a_loss_workload_shows_its_metric_around_its_targets():
    """A problem whose metric is a loss (lower is better, targets descending) gets its metric's
    name on the y axis and a y range that holds both targets and the curve's approach."""
    from paper_figs import ttr

    entries = [
        {
            "problem": "fortunes_gpt",
            "optimizer": opt,
            "spec": {"targets": [2.98, 2.83], "lower_is_better": True},
            "runs": [
                {
                    "seed": 0,
                    "steps_to": {"2.98": 75, "2.83": 100},
                    "curve": [[25 * k, 0.0, 3.4 - 0.15 * k] for k in range(5)],
                }
            ],
        }
        for opt in ("adam", "muon", "eigen_adam")
    ]
    table = [
        {"problem": "fortunes_gpt", "optimizer": e["optimizer"], "cost_per_step_s": 0.1}
        for e in entries
    ]
    fig = ttr.ttr_figure(entries, {"table": table, "meta": {"threads": 1}})
    for ax in fig.axes:
        assert ax.get_ylabel() == "validation bits/char"
        low, high = ax.get_ylim()
        assert low < 2.83 < 2.98 < 3.4 < high
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert labels == ["Adam", "Muon (torch) + AdamW", "EigenAdam"]


def test_ttr_figure_one_line_per_optimizer_in_each_panel():
    """5 optimizers x 3 seeds on 2 problems: 2 panels per problem (steps, estimated seconds),
    one line per optimizer (its seed-0 run), the seconds axis scaled by the cost per step."""
    from paper_figs import ttr

    optimizers = ("momentum", "adam", "kfac", "diagggn_mc", "ekfac")
    entries = [
        {
            "problem": problem,
            "optimizer": opt,
            "spec": {"targets": [0.88, 0.9]},
            "runs": [
                {
                    "seed": seed,
                    "steps_to": {"0.88": 50, "0.9": 100 + seed},
                    "curve": [[25 * k, 0.0, 0.8 + 0.025 * k] for k in range(5)],
                }
                for seed in range(3)
            ],
        }
        for problem in ("mnist_logreg", "fmnist_2c2d")
        for opt in optimizers
    ]
    table = [
        {"problem": e["problem"], "optimizer": e["optimizer"], "cost_per_step_s": 0.5}
        for e in entries
        if e["optimizer"] != "ekfac"  # no cost measured: not on the seconds axis
    ]
    fig = ttr.ttr_figure(entries, {"table": table, "meta": {"threads": 1}})
    assert len(fig.axes) == 4
    for k, ax in enumerate(fig.axes):
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert len(labels) == (5 if k % 2 == 0 else 4) <= 6
        curves = [line for line in ax.get_lines() if len(line.get_xdata()) == 5]
        assert max(max(c.get_xdata()) for c in curves) == (100 if k % 2 == 0 else 50)


# ------------------------------------------------------------ every figure fits its canvas
def _outside_the_canvas(fig) -> list[str]:
    """The edges of the canvas that what ``fig`` draws (titles, labels, ticks, annotations,
    legends: its tight bounding box) reaches past, by more than half a point."""
    box = fig.get_tightbbox(fig.canvas.get_renderer())  # inches
    width, height = fig.get_size_inches()
    slack = 0.5 / 72
    edges = {"left": box.x0 < -slack, "bottom": box.y0 < -slack,
             "right": box.x1 > width + slack, "top": box.y1 > height + slack}  # fmt: skip
    return [edge for edge, out in edges.items() if out]


def _drawn(module, monkeypatch) -> list:
    """The figures ``module`` saves from now on."""
    figures = []

    def keep(fig, path):
        figures.append(fig)
        return common.save(fig, path)

    monkeypatch.setattr(module, "save", keep)
    return figures


def _make_run_overhead(problems: tuple[str, ...]) -> dict:
    """An overhead JSON as ``make run`` writes it: every quantity, BackPACK beside curvopt, the
    full panel title (gradient time, versus BackPACK, the other processes' load)."""
    results = []
    for problem in problems:
        results.append({"problem": problem, "quantity": "plain", "backend": "plain",
                        "ratio_median": 1.0, "ratio_q1": 1.0, "ratio_q3": 1.0})  # fmt: skip
        for i, quantity in enumerate(q for q in overhead.QUANTITY_LABELS):
            for backend in ("curvopt", "backpack"):
                ratio = 1.2 + 0.9 * i + (0.4 if backend == "backpack" else 0.0)
                results.append({
                    "problem": problem, "quantity": quantity, "backend": backend,
                    "ratio_median": ratio, "ratio_q1": ratio - 0.1, "ratio_q3": ratio + 0.1,
                    "versus_backpack": 0.8 if backend == "curvopt" else None, "error": None,
                })  # fmt: skip
    return {
        "torch": "2.13.0+cpu", "threads": 2, "device": "cpu", "cpu_count": 2,
        "load_average_at_start": 1.37, "backends": ["curvopt", "backpack"],
        "problems": {
            p: {"description": f"DeepOBS {p.upper()}, CIFAR-10 shapes, N=64", "batch_size": 64,
                "plain_ms": 123.4, "other_load_median": 0.12}
            for p in problems
        },
        "results": results,
    }  # fmt: skip


@pytest.mark.parametrize("problems", [("3c3d",), ("3c3d", "2c2d", "logreg")])
def test_the_overhead_figure_fits_its_canvas(problems, tmp_path, monkeypatch):
    """The overhead figure of ``make run`` (one panel) and of several problems: no title, label
    or number reaches past the canvas (the panel titles are wrapped to the panel's width)."""
    figures = _drawn(overhead, monkeypatch)
    source = _write(tmp_path / "o", _make_run_overhead(problems), "overhead")
    assert _is_png(paper_figs.plot_overhead(source, tmp_path / "f")[0])
    (fig,) = figures
    assert not _outside_the_canvas(fig)
    titles = "".join(ax.get_title() for ax in fig.axes)
    assert "curvopt/BackPACK time: 0.80" in titles and "12% of the CPUs" in titles


def test_the_curve_figures_fit_their_canvas(results, tmp_path, monkeypatch):
    figures = _drawn(curves, monkeypatch)
    paper_figs.plot_curves(results, tmp_path / "figs")
    assert len(figures) == 3
    for fig in figures:
        assert not _outside_the_canvas(fig)


def test_the_check_finds_a_title_past_the_edge():
    fig = common.new_figure(4, 3)
    fig.subplots(1, 1).set_title("a title far too long for a figure four inches wide " * 2)
    assert _outside_the_canvas(fig)


def test_the_comparison_figure_fits_its_canvas_and_its_numbers_stand_out(tmp_path, monkeypatch):
    """The figure of ``experiments compare`` (from the stored FMNIST 2C2D result): inside its
    canvas, and each heatmap number in black on a light cell, white on a dark one."""
    from matplotlib.colors import to_rgb

    from paper_figs import compare

    figures = _drawn(compare, monkeypatch)
    results = Path(__file__).resolve().parents[1] / "experiments" / "results" / "compare"
    assert compare.plot_compare(results, tmp_path)
    for fig in figures:
        assert not _outside_the_canvas(fig)
        for ax in fig.axes[:4]:
            for image in ax.get_images():
                for text in ax.texts:
                    if text.get_text() == "n/a":
                        continue
                    cell = image.cmap(image.norm(float(text.get_text())))
                    light = 0.299 * cell[0] + 0.587 * cell[1] + 0.114 * cell[2] > 0.5
                    assert to_rgb(text.get_color()) == ((0, 0, 0) if light else (1, 1, 1))
