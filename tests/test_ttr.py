"""The time-to-result protocol on tiny learnable data: targets stop runs, steps are counted,
evaluation is off the clock, tuning picks by steps, the cost measurement interleaves, the JSON
files and the figure."""

import json
import os
import platform
import time

import pytest
from ttr_data import band_splits

import paper_figs
from experiments.__main__ import main
from experiments.ttr import cli as ttr_cli
from experiments.ttr import cost as cost_mod
from experiments.ttr import protocol
from experiments.ttr.cost import measure_costs, period
from experiments.ttr.protocol import RunResult, Setting, TtrProblem, select, train_to_targets
from experiments.ttr.report import machines_note, markdown_table, median_steps, summarize
from experiments.ttr.schedules import lr_factor


@pytest.fixture(scope="module")
def splits():
    return band_splits()


ADAM = Setting("adam", 0.01)


def test_run_stops_at_the_first_evaluation_reaching_the_highest_target(splits):
    spec = TtrProblem(targets=(0.3, 0.6), max_steps=400, eval_every=3, eval_size=200)
    run = train_to_targets(ADAM, "mnist_logreg", spec, splits, seed=0)
    assert run.status == "reached"
    steps, _, acc = zip(*run.curve)
    assert steps[0] == 0 and all(s % 3 == 0 for s in steps)  # step 0, then every 3 steps
    assert run.steps == steps[-1] == run.steps_to["0.6"] and acc[-1] >= 0.6 > max(acc[:-1])
    first = next(s for s, _, a in run.curve if a >= 0.3)
    assert run.steps_to["0.3"] == first <= run.steps_to["0.6"]
    assert run.seconds_to["0.6"] == pytest.approx(run.train_s)


def test_unreachable_target_runs_exactly_the_step_cap(splits):
    spec = TtrProblem(targets=(1.01,), max_steps=11, eval_every=5, eval_size=200)
    run = train_to_targets(ADAM, "mnist_logreg", spec, splits, seed=0)
    assert run.status == "capped" and run.steps == 11 and run.steps_to == {"1.01": None}
    assert [s for s, _, _ in run.curve] == [0, 5, 10, 11]  # the cap is evaluated too


def test_a_tuning_run_past_the_best_steps_is_pruned_at_that_evaluation(splits):
    spec = TtrProblem(targets=(1.01,), max_steps=100, eval_every=5, eval_size=200)
    run = train_to_targets(ADAM, "mnist_logreg", spec, splits, seed=0, prune_at=10)
    assert run.status == "pruned" and run.steps == 10 and run.curve[-1][0] == 10
    spec = TtrProblem(targets=(0.3,), max_steps=100, eval_every=5, eval_size=200)
    reached = train_to_targets(ADAM, "mnist_logreg", spec, splits, seed=0)
    tie = train_to_targets(ADAM, "mnist_logreg", spec, splits, 0, prune_at=reached.steps)
    assert tie.status == "reached" and tie.steps_to == reached.steps_to  # a tie is not pruned


def test_evaluation_is_off_the_training_clock(splits, monkeypatch):
    original = protocol.split_sums

    def slow(*args):
        time.sleep(0.05)
        return original(*args)

    monkeypatch.setattr(protocol, "split_sums", slow)
    spec = TtrProblem(targets=(1.01,), max_steps=20, eval_every=2, eval_size=200)
    run = train_to_targets(ADAM, "mnist_logreg", spec, splits, seed=0)
    assert len(run.curve) == 11 and run.eval_s >= 0.05 * 11
    assert run.train_s < 0.05 * 11  # 20 logreg steps take far less than the evaluations
    # the training clock is the sum of the step phases: no evaluation in it
    assert sum(run.per_step_s.values()) * run.steps == pytest.approx(run.train_s, rel=1e-6)
    times = [t for _, t, _ in run.curve]
    assert times == sorted(times)


def test_warmup_cosine_schedule_and_its_use_in_a_run(splits, monkeypatch):
    assert lr_factor("constant", 7, 100) == 1.0
    assert [lr_factor("warmup_cosine", t, 100) for t in range(5)] == [0.2, 0.4, 0.6, 0.8, 1.0]
    assert lr_factor("warmup_cosine", 5 + 95 // 2, 100) == pytest.approx(0.5, abs=0.02)
    assert lr_factor("warmup_cosine", 99, 100) < 0.001
    with pytest.raises(ValueError, match="unknown schedule"):
        lr_factor("step", 0, 10)
    seen = []
    step = protocol.timed_step

    def record(net, lossfunc, opt, *args):
        seen.append(opt.param_groups[0]["lr"])
        return step(net, lossfunc, opt, *args)

    monkeypatch.setattr(protocol, "timed_step", record)
    spec = TtrProblem(targets=(1.01,), max_steps=40, eval_every=40, eval_size=200)
    train_to_targets(
        Setting("adam", 0.01, schedule="warmup_cosine"), "mnist_logreg", spec, splits, 0
    )
    assert seen[:2] == pytest.approx([0.005, 0.01]) and seen[-1] < 0.0001  # warm-up: 2 steps


def _result(lr, steps_to, seed=0):
    return RunResult(Setting("adam", lr).as_dict(), seed, steps_to, dict(steps_to), "x")


def test_selection_by_steps_to_the_highest_target_then_the_lower_ones():
    targets = (0.88, 0.9)
    runs = [
        _result(0.1, {"0.88": 100, "0.9": None}),  # fastest to 0.88, never 0.90
        _result(0.2, {"0.88": 300, "0.9": 500}),
        _result(0.3, {"0.88": 200, "0.9": 500}),  # tie at 0.90, fewer steps to 0.88
        _result(0.4, {"0.88": 200, "0.9": 500}),  # same as the one before: the first wins
    ]
    assert select(runs, targets) == 2
    assert select(runs[:1], targets) == 0  # nothing reached: the first


def test_tuning_runs_every_setting_with_seed_0_then_the_winner_with_the_other_seeds(
    splits, monkeypatch
):
    calls = []

    def fake(setting, problem, spec, splits, seed, prune_at=None):
        calls.append((setting.lr, seed, prune_at))
        steps = {0.1: 50, 0.2: 20, 0.3: None, 0.4: 30}[setting.lr]
        return _result(setting.lr, {"0.5": steps}, seed)

    monkeypatch.setattr(protocol, "train_to_targets", fake)
    spec = TtrProblem(targets=(0.5,), max_steps=100)
    grid = tuple(Setting("adam", lr) for lr in (0.1, 0.2, 0.3, 0.4))
    entry = protocol.tune_and_run("mnist_logreg", grid, spec, splits, 3, log=len)
    # each tuning run may stop at the best steps so far; the seeds run in full
    assert calls == [
        (0.1, 0, None),
        (0.2, 0, 50),
        (0.3, 0, 20),
        (0.4, 0, 20),
        (0.2, 1, None),
        (0.2, 2, None),
    ]
    assert entry["winner"] == 1 and [r["seed"] for r in entry["runs"]] == [0, 1, 2]
    assert entry["runs"][0] == entry["tuning"][1]


def test_committed_grids_give_every_optimizer_at_least_4_settings_and_baselines_a_schedule():
    for grids in protocol.GRIDS.values():
        for optimizer, settings in grids.items():
            assert len(settings) >= 4 and {s.optimizer for s in settings} == {optimizer}
        assert "adam" in grids  # momentum SGD is left out of issue 53's workloads
        for baseline in ("momentum", "adam"):
            if baseline in grids:
                assert {s.schedule for s in grids[baseline]} == {"constant", "warmup_cosine"}


def test_cost_blocks_alternate_round_robin_and_amortise_the_curvature_interval(splits, monkeypatch):
    entries = {
        "adam": ADAM,
        "kfac": Setting("kfac", 0.01, 0.1, preset="practical"),
        "momentum": Setting("momentum", 0.01),
    }
    assert period(entries["kfac"]) == 10 and period(ADAM) == 1
    order = []
    step = cost_mod.timed_step

    def record(net, lossfunc, opt, *args):
        order.append(type(opt).__name__)
        return step(net, lossfunc, opt, *args)

    monkeypatch.setattr(cost_mod, "timed_step", record)
    out = measure_costs("mnist_logreg", entries, splits, rounds=2, warmup=1, log=len)
    assert out["block"] == 10
    assert out["sequence"] == ["adam", "kfac", "momentum", "kfac", "momentum", "adam"] + [
        "momentum",
        "adam",
        "kfac",
    ]
    blocks = [order[i : i + 10] for i in range(0, len(order), 10)]
    assert len(blocks) == 9 and all(len(set(b)) == 1 for b in blocks)  # 10 steps per block
    for e in out["entries"].values():
        assert len(e["rounds_cpu_s"]) == 2 and e["per_step_s"] > 0 and e["failed"] is None
        assert e["per_step_s"] == pytest.approx(sum(e["rounds_cpu_s"]) / 2)


def test_median_steps_counts_not_reached_as_infinite():
    assert median_steps([300, None, 100]) == 300
    assert median_steps([None, None, 100]) is None
    assert median_steps([4]) == 4


def _entry(optimizer, steps, lr=0.1):
    setting = Setting(optimizer, lr).as_dict()
    runs = [
        {"seed": s, "setting": setting, "steps_to": {"0.9": n}, "seconds_to": {"0.9": n and n / 10}}
        for s, n in enumerate(steps)
    ]
    spec = {"targets": [0.9]}
    return {
        "problem": "p",
        "optimizer": optimizer,
        "spec": spec,
        "tuning": runs[:1],
        "winner": 0,
        "runs": runs,
    }


def test_summary_multiplies_median_steps_by_cost_and_divides_by_adam():
    entries = [_entry("adam", [100, 120, 110]), _entry("momentum", [50, None, 70])]
    costs = {
        "problems": {
            "p": {
                "entries": {
                    "adam": {
                        "setting": Setting("adam", 0.1).as_dict(),
                        "per_step_s": 0.01,
                        "per_step_wall_s": 0.02,
                    },
                    # measured for another setting than the winner: not used
                    "momentum": {
                        "setting": Setting("momentum", 0.5).as_dict(),
                        "per_step_s": 0.001,
                        "per_step_wall_s": 0.001,
                    },
                },
                "meta": {"machine": "CPU A, 2 logical CPUs"},
            }
        }
    }
    adam, momentum = summarize(entries, costs)
    assert adam["cost_machine"] == "CPU A, 2 logical CPUs" and momentum["cost_machine"] is None
    assert machines_note([adam, momentum]) == "* p: ms/step measured on CPU A, 2 logical CPUs"
    assert machines_note([momentum]) == ""
    assert adam["steps"] == {"0.9": 110} and adam["est_s"]["0.9"] == pytest.approx(1.1)
    assert adam["est_ratio_to_adam"] == 1.0 and adam["wall_s"] == pytest.approx(11.0)
    assert momentum["steps"] == {"0.9": 70} and momentum["cost_per_step_s"] is None
    assert momentum["est_ratio_to_adam"] is None
    assert momentum["wall_ratio_to_adam"] == pytest.approx(7.0 / 11.0)
    assert adam["best_peer"] == "adam" and adam["est_ratio_to_best_peer"] == 1.0
    assert momentum["est_ratio_to_best_peer"] is None
    table = markdown_table([adam, momentum])
    row = "| p | adam lr 0.1 | - | 0.9 | 110 | 100, 120, 110 | 10.0 / 20.0 | 1.1 | 1.00 |"
    assert row + " 1.00 (adam) | 11.0 | 1.00 |" in table
    assert "| 50, -, 70 | - | - | - | - | 7.0 | 0.64 |" in table


def test_the_best_peer_is_the_fastest_optimizer_curvopt_does_not_provide():
    """A curvopt optimizer faster than every peer is not the best peer; each row's estimate is
    divided by the fastest peer's (here schedule-free AdamW, faster than Adam)."""
    names = ("adam", "sf_adamw", "kfac", "sf_kfac")
    entries = [_entry(name, [100]) for name in names]
    seconds = {"adam": 0.02, "sf_adamw": 0.01, "kfac": 0.03, "sf_kfac": 0.005}
    costs = {
        "problems": {
            "p": {
                "entries": {
                    n: {
                        "setting": Setting(n, 0.1).as_dict(),
                        "per_step_s": seconds[n],
                        "per_step_wall_s": seconds[n],
                    }
                    for n in names
                }
            }
        }
    }
    rows = {r["optimizer"]: r for r in summarize(entries, costs)}
    assert {r["best_peer"] for r in rows.values()} == {"sf_adamw"}
    ratios = {n: rows[n]["est_ratio_to_best_peer"] for n in names}
    assert ratios == pytest.approx({"adam": 2.0, "sf_adamw": 1.0, "kfac": 3.0, "sf_kfac": 0.5})
    assert "| 0.50 (sf_adamw) |" in markdown_table(list(rows.values()))


def test_cli_ttr_then_ttr_cost_write_the_json_files_and_the_figure_draws(
    tmp_path, capsys, monkeypatch
):
    out = tmp_path / "ttr"
    args = ["ttr", "--quick", "--synthetic", "--problems", "mnist_logreg", "--json", str(out)]
    extra = ["--optimizers", "adam", "kfac", "--seeds", "2", "--max-steps", "10"]
    assert main(args + extra + ["--batch-sizes", "128"]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["mnist_logreg_adam.json", "mnist_logreg_kfac.json", "summary.json", "ttr.md"]
    entry = json.loads((out / "mnist_logreg_kfac.json").read_text())
    assert {"problem", "optimizer", "spec", "tuning", "winner", "runs", "meta"} <= set(entry)
    assert entry["spec"]["max_steps"] == 10 and entry["spec"]["targets"] == [0.92]
    assert len(entry["tuning"]) == 4 and [r["seed"] for r in entry["runs"]] == [0, 1]
    run = entry["runs"][1]
    assert {
        "setting",
        "seed",
        "steps_to",
        "seconds_to",
        "status",
        "steps",
        "train_s",
        "eval_s",
        "per_step_s",
        "curve",
    } <= set(run)
    assert entry["meta"]["synthetic"] is True and entry["meta"]["threads"] == 1
    summary = json.loads((out / "summary.json").read_text())
    assert [r["cost_per_step_s"] for r in summary["table"]] == [None, None]

    cost_args = ["ttr_cost", "--synthetic", "--from", str(out), "--rounds", "1", "--warmup", "0"]
    assert main(cost_args) == 0
    cost = json.loads((out / "cost.json").read_text())["problems"]["mnist_logreg"]
    assert set(cost["entries"]) == {"adam", "kfac"} and cost["block"] == 10
    table = json.loads((out / "summary.json").read_text())["table"]
    assert all(r["cost_per_step_s"] > 0 for r in table)
    # the CPU model that measured the costs: in cost.json, the log, the rows and under the table
    machine = cost["meta"]["machine"]
    assert machine.endswith("logical CPUs") and all(r["cost_machine"] == machine for r in table)
    assert f"mnist_logreg cost on {machine}, torch " in capsys.readouterr().out
    assert f"\n\n* mnist_logreg: ms/step measured on {machine}\n" in (out / "ttr.md").read_text()

    def concurrent(problem, *args, **kwargs):
        """Another problem's ttr_cost writes cost.json while this one measures."""
        other = json.loads((out / "cost.json").read_text())
        other["problems"]["other"] = {"entries": {}, "meta": {}}
        (out / "cost.json").write_text(json.dumps(other))
        return dict(cost)

    monkeypatch.setattr(ttr_cli, "measure_costs", concurrent)
    assert main(cost_args) == 0
    kept = json.loads((out / "cost.json").read_text())["problems"]
    assert set(kept) == {"mnist_logreg", "other"} and kept["mnist_logreg"]["block"] == 10
    paths = paper_figs.plot_ttr(out, tmp_path / "figs")
    assert [p.name for p in paths] == ["ttr.png"] and paths[0].read_bytes()[:4] == b"\x89PNG"
    assert paper_figs.plot_ttr(tmp_path / "nothing", tmp_path / "figs") == []


def test_cli_rejects_unknown_optimizers_and_missing_results(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["ttr", "--optimizers", "lbfgs"])
    assert "invalid choice" in capsys.readouterr().err
    assert main(["ttr_cost", "--from", str(tmp_path)]) == 2
    assert "run python -m experiments ttr first" in capsys.readouterr().err


def test_problems_fix_their_targets_before_tuning():
    assert protocol.TTR_PROBLEMS["fmnist_2c2d"].targets == (0.88, 0.90)
    assert protocol.TTR_PROBLEMS["mnist_logreg"].targets == (0.92,)
    assert protocol.TTR_PROBLEMS["fmnist_vit"].targets == (0.84, 0.86)  # from Adam's calibration
    with pytest.raises(ValueError, match="ascending"):
        TtrProblem(targets=(0.9, 0.88), max_steps=10)


def test_a_resumed_tuning_takes_the_earlier_runs_and_trains_only_what_is_missing(
    splits, monkeypatch
):
    """An earlier entry (its settings written without a batch size, as before the batch size
    was tuned) holds lr 0.1 (50 steps) and lr 0.3 pruned at 50 steps: lr 0.1 is taken, lr 0.2
    trains, lr 0.3 would now be pruned at 20 steps, earlier than it was, so it is taken too;
    the winner's seed 1 is trained, a run pruned later than now must train again."""
    calls = []

    def fake(setting, problem, spec, splits, seed, prune_at=None):
        calls.append((setting.lr, seed, prune_at))
        steps = {0.1: 50, 0.2: 20, 0.3: None}[setting.lr]
        return _result(setting.lr, {"0.5": steps}, seed)

    monkeypatch.setattr(protocol, "train_to_targets", fake)
    spec = TtrProblem(targets=(0.5,), max_steps=100)
    old_grid = (Setting("adam", 0.1), Setting("adam", 0.3))
    earlier = protocol.tune_and_run("mnist_logreg", old_grid, spec, splits, 1, log=len)
    assert calls == [(0.1, 0, None), (0.3, 0, 50)] and earlier["reused_runs"] == 0
    for run in earlier["tuning"] + earlier["runs"]:
        del run["setting"]["batch_size"]
    earlier["tuning"][1]["status"], earlier["tuning"][1]["steps"] = "pruned", 50
    earlier = json.loads(json.dumps(earlier))  # as read back from its file
    done = protocol.reusable_runs(earlier, "mnist_logreg", spec)
    assert set(done) == {(Setting("adam", lr, batch_size=128), 0) for lr in (0.1, 0.3)}

    calls.clear()
    grid = tuple(Setting("adam", lr, batch_size=128) for lr in (0.1, 0.2, 0.3))
    entry = protocol.tune_and_run("mnist_logreg", grid, spec, splits, 2, log=len, done=done)
    assert calls == [(0.2, 0, 50), (0.2, 1, None)] and entry["reused_runs"] == 2
    assert entry["winner"] == 1 and entry["tuning"][0]["setting"]["batch_size"] == 128
    assert entry["tuning"][0]["steps_to"] == {"0.5": 50}

    calls.clear()
    pruned_late = {(Setting("adam", 0.3, batch_size=128), 0): done[grid[2], 0]}
    monkeypatch.setitem(pruned_late[grid[2], 0].__dict__, "steps", 10)
    protocol.tune_and_run("mnist_logreg", grid, spec, splits, 1, log=len, done=pruned_late)
    assert calls == [(0.1, 0, None), (0.2, 0, 50), (0.3, 0, 20)]
    other_spec = TtrProblem(targets=(0.6,), max_steps=100)
    assert protocol.reusable_runs(earlier, "mnist_logreg", other_spec) == {}


def test_cli_tunes_the_chosen_settings_and_resumes_from_its_own_file(tmp_path, capsys):
    out = tmp_path / "ttr"
    args = ["ttr", "--quick", "--synthetic", "--problems", "mnist_logreg", "--json", str(out)]
    args += ["--optimizers", "adam", "--seeds", "2", "--max-steps", "6", "--batch-sizes", "128"]
    assert main(args + ["--settings", "0", "2"]) == 0
    path = out / "mnist_logreg_adam.json"
    first = json.loads(path.read_text())
    assert [r["setting"]["lr"] for r in first["tuning"]] == [1e-3, 3e-3]
    assert first["reused_runs"] == 0 and "earlier" not in first["meta"]
    assert main(args + ["--settings", "0", "1", "2", "--resume"]) == 0
    second = json.loads(path.read_text())
    assert len(second["tuning"]) == 3 and second["reused_runs"] >= 2
    assert second["tuning"][0] == first["tuning"][0]
    assert second["meta"]["earlier"] == first["meta"]
    assert "(reused)" in capsys.readouterr().out
    assert main(args + ["--settings", "9"]) == 2
    assert "--settings 9 is past its grid of 8 settings (0 to 7)" in capsys.readouterr().err


def test_the_machine_is_the_cpu_model_with_its_numbers(tmp_path):
    """A virtual machine's generic model name gets its family, model and stepping; without
    ``/proc/cpuinfo`` the platform's name stands in."""
    cpuinfo = tmp_path / "cpuinfo"
    core = "processor\t: {}\ncpu family\t: 6\nmodel\t\t: 167\n"
    core += "model name\t: Intel(R) Xeon(R) Processor\n"
    cpuinfo.write_text(core.format(0) + "stepping\t: 1\n\n" + core.format(1) + "stepping\t: 1\n")
    machine, cpus = ttr_cli._machine(cpuinfo).rsplit(", ", 1)
    assert machine == "Intel(R) Xeon(R) Processor (family 6, model 167, stepping 1)"
    assert cpus == f"{os.cpu_count()} logical CPUs"
    fallback = platform.processor() or platform.machine()
    assert ttr_cli._machine(tmp_path / "missing") == f"{fallback}, {os.cpu_count()} logical CPUs"
