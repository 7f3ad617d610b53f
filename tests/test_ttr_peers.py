"""The time-to-result benchmark's peers (SOAP, PSGD-Kron, schedule-free AdamW), its batch-size
axis, the ViT problem and the calibration of a new problem's targets; old result files."""

import json
import pathlib
from dataclasses import replace

import pytest
import torch
from ttr_data import band_splits

from experiments import peers
from experiments.__main__ import main
from experiments.problems import get_problem
from experiments.ttr import cost, protocol
from experiments.ttr.grids import BATCH_SIZES, GRIDS, WORKLOAD_BATCH, Setting
from experiments.ttr.protocol import RunResult, TtrProblem, train_to_targets, tune_and_run
from experiments.ttr.report import load_costs, load_entries, markdown_table, summarize

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "results" / "ttr"


@pytest.fixture(scope="module")
def splits():
    return band_splits()


@pytest.fixture
def eager(monkeypatch):
    """heavyball's peers without compilation (inductor takes minutes)."""
    monkeypatch.setattr(peers, "COMPILE_MODES", ())


SPEC = TtrProblem(targets=(0.5,), max_steps=30, eval_every=10, eval_size=200)


@pytest.mark.parametrize(
    "name, lr, package",
    [
        ("soap", 3e-3, "heavyball"),
        ("psgd_kron", 1e-3, "heavyball"),
        ("sf_adamw", 1e-2, "schedulefree"),
    ],
)
def test_peers_build_and_train_on_a_tiny_problem(splits, eager, name, lr, package):
    pytest.importorskip(package)
    run = train_to_targets(Setting(name, lr), "mnist_logreg", SPEC, splits, seed=0)
    accuracies = [acc for _, _, acc in run.curve]
    assert run.status == "reached" and accuracies[-1] >= 0.5 > accuracies[0]
    if package == "heavyball":
        assert run.compile["compiled"] is False and run.compile["mode"] is None
        assert run.compile["failures"] == {} and run.compile["compile_s"] >= 0
    else:
        assert run.compile is None


def test_a_compile_mode_that_fails_is_recorded_and_the_peer_runs_eager(splits, monkeypatch):
    pytest.importorskip("heavyball")
    monkeypatch.setattr(peers, "COMPILE_MODES", ("no-such-mode",))
    monkeypatch.setattr(peers, "_FAILED", {})
    tried = []
    mode_of = peers._compile_mode

    def record(mode):
        tried.append(mode)
        return mode_of(mode)

    monkeypatch.setattr(peers, "_compile_mode", record)
    run = train_to_targets(Setting("soap", 3e-3), "mnist_logreg", SPEC, splits, seed=0)
    assert run.compile["compiled"] is False and run.compile["mode"] is None
    assert "no-such-mode" in run.compile["failures"] and run.status == "reached"
    assert tried.count("no-such-mode") == 1 and set(tried) == {"no-such-mode", None}
    again = train_to_targets(Setting("soap", 3e-3), "mnist_logreg", SPEC, splits, seed=1)
    assert tried.count("no-such-mode") == 1  # a failed mode is not tried again
    assert again.compile["failures"] == run.compile["failures"]
    # the probe's seconds count in the run's wall-clock, not in its steps' phases
    assert run.train_s == pytest.approx(
        run.compile["compile_s"] + sum(run.per_step_s.values()) * run.steps
    )


def test_schedule_free_is_evaluated_at_its_average_without_changing_the_training(
    splits, monkeypatch
):
    """Each evaluation sees schedule-free's averaged weights ``x`` (state ``x`` of the
    package's reference implementation, stepped on the same batches), and evaluating at every
    step leaves the trajectory as evaluating every 5 steps does."""
    schedulefree = pytest.importorskip("schedulefree")
    setting = Setting("sf_adamw", 0.01)
    spec = TtrProblem(targets=(1.01,), max_steps=12, eval_every=1, eval_size=200)
    seen: dict[int, list] = {}
    reference: list = []
    original_sums, original_step = protocol.split_sums, protocol.timed_step

    def sums(model, *args):
        seen.setdefault(len(seen), [p.detach().clone() for p in model.parameters()])
        return original_sums(model, *args)

    def step(net, lossfunc, opt, collects, x, y, clock):
        if not reference:  # a copy of the initial model, stepped by the reference optimizer
            twin = get_problem("mnist_logreg").model(0)
            ref = schedulefree.AdamWScheduleFreeReference(twin.parameters(), lr=0.01)
            ref.train()
            reference.extend([twin, ref, []])
        twin, ref, xs = reference
        ref.zero_grad()
        lossfunc(twin(x), y).backward()
        ref.step()
        xs.append([(ref.state[p]["x"].clone(), p.detach().clone()) for p in twin.parameters()])
        return original_step(net, lossfunc, opt, collects, x, y, clock)

    monkeypatch.setattr(protocol, "split_sums", sums)
    monkeypatch.setattr(protocol, "timed_step", step)
    every = train_to_targets(setting, "mnist_logreg", spec, splits, seed=0)
    assert [s for s, _, _ in every.curve] == list(range(13))
    initial = [p.detach() for p in get_problem("mnist_logreg").model(0).parameters()]
    assert all(torch.equal(a, b) for a, b in zip(seen[0], initial))
    for k in range(1, 13):
        for got, (x, _) in zip(seen[k], reference[2][k - 1]):
            torch.testing.assert_close(got, x, rtol=1e-5, atol=1e-6)
    # the training parameters y are not the average x: the evaluation did switch
    x, y = reference[2][-1][0]
    assert (x - y).abs().max() > 1e-3

    at_every = dict(seen)
    seen.clear()
    reference.clear()
    sparse = train_to_targets(
        setting, "mnist_logreg", TtrProblem((1.01,), 12, 5, 200), splits, seed=0
    )
    assert [s for s, _, _ in sparse.curve] == [0, 5, 10, 12]
    for i, k in enumerate((0, 5, 10, 12)):
        assert all(torch.equal(a, b) for a, b in zip(seen[i], at_every[k]))
        assert sparse.curve[i][2] == every.curve[k][2]


def test_every_grid_has_its_settings_at_every_batch_size():
    """4 settings at each batch size (fmnist_2c2d: at 128; at 512 only Adam, schedule-free
    AdamW, KFAC and schedule-free KFAC, with 2: a setting of batch 128 and the same with twice
    its lr)."""
    for problem, grids in GRIDS.items():
        for optimizer, settings in grids.items():
            if problem in WORKLOAD_BATCH:  # issue 53's workloads: 4 at their own batch size
                assert [s.batch_size for s in settings] == [WORKLOAD_BATCH[problem]] * 4
                continue
            by_batch = {b: [s for s in settings if s.batch_size == b] for b in BATCH_SIZES}
            assert sum(map(len, by_batch.values())) == len(settings)
            points = {
                b: [(s.lr, s.damping, s.preset, s.options, s.schedule) for s in v]
                for b, v in by_batch.items()
            }
            assert len(points[128]) == 4
            if problem != "fmnist_2c2d":
                assert points[512] == points[128]
            elif optimizer in ("adam", "sf_adamw", "kfac", "sf_kfac"):
                (a, *rest), (b, *same) = points[512]
                assert (a, *rest) in points[128] and b == 2 * a and same == rest
            else:
                assert points[512] == []
    assert set(BATCH_SIZES) >= {128, 512}
    assert {s.schedule for s in GRIDS["fmnist_2c2d"]["sf_adamw"]} == {"warmup"}


def test_schedule_free_kfac_is_evaluated_at_its_average(splits, monkeypatch):
    """``sf_kfac`` (KFAC's ``schedule_free`` preset) is evaluated at ``x = (y − (1 − β) z) / β``
    of its last training point ``y``, and trains as without evaluations."""
    setting = GRIDS["fmnist_vit"]["sf_kfac"][0]
    setting = replace(setting, options=(("kl_clip", 0.1),), batch_size=None)
    spec = TtrProblem(targets=(1.01,), max_steps=6, eval_every=1, eval_size=200)
    trained: list = []  # (optimizer, the parameters y after each step)
    seen: list = []
    original_sums, original_step = protocol.split_sums, protocol.timed_step

    def step(net, lossfunc, opt, collects, x, y, clock):
        out = original_step(net, lossfunc, opt, collects, x, y, clock)
        trained.append((opt, [p.detach().clone() for p in net.parameters()]))
        return out

    def sums(model, *args):
        seen.append([p.detach().clone() for p in model.parameters()])
        return original_sums(model, *args)

    monkeypatch.setattr(protocol, "timed_step", step)
    monkeypatch.setattr(protocol, "split_sums", sums)
    every = train_to_targets(setting, "mnist_logreg", spec, splits, seed=0)
    opt, ys = trained[-1]
    params = [p for g in opt.param_groups for p in g["params"]]
    assert opt.param_groups[0]["schedule_free"] == 0.9 and opt.param_groups[0]["momentum"] == 0
    for got, y, p in zip(seen[-1], ys, params):
        z = opt.state[p]["schedule_free"]["z"]
        torch.testing.assert_close(got, (y - 0.1 * z) / 0.9, rtol=1e-5, atol=1e-6)
        assert (got - y).abs().max() > 1e-4  # the evaluation did switch to x
    final = ys
    trained.clear()
    sparse = train_to_targets(setting, "mnist_logreg", TtrProblem((1.01,), 6, 6, 200), splits, 0)
    assert all(torch.equal(a, b) for a, b in zip(trained[-1][1], final))
    assert sparse.curve[-1][2] == every.curve[-1][2]


@pytest.mark.parametrize("optimizer", ["adam", "sf_adamw", "kfac"])
def test_the_batch_512_settings_of_2c2d_train_a_few_steps(splits, optimizer):
    """Every batch-512 configuration of the grid takes its capped steps. Settings that differ
    only in their learning rate (the batch-128 winner and twice it) share one run: the rate is
    a scalar of the same update, so a second run would test the same code again."""
    pytest.importorskip("schedulefree")
    spec = TtrProblem(targets=(1.01,), max_steps=8, eval_every=8, eval_size=200)
    settings = [s for s in GRIDS["fmnist_2c2d"][optimizer] if s.batch_size == 512]
    by_configuration = {replace(s, lr=0.0): s for s in reversed(settings)}  # the first rate
    assert by_configuration, f"fmnist_2c2d has no batch-512 {optimizer} setting"
    for setting in by_configuration.values():
        run = train_to_targets(setting, "fmnist_2c2d", spec, splits, seed=0)
        assert run.steps == 2 and run.status == "capped" and run.batch_size == 512
        assert run.curve[-1][2] > 0


def test_psgd_kron_runs_eager_on_the_cpu_without_trying_to_compile(monkeypatch):
    pytest.importorskip("heavyball")

    def no_probe(*args):
        raise AssertionError("PSGD-Kron was compiled on the CPU")

    monkeypatch.setattr(peers, "_probe", no_probe)
    w = torch.nn.Parameter(torch.randn(6, 4))
    opt = peers.build_peer("psgd_kron", [{"params": [w]}], lr=1e-3)
    info = peers.compile_info(opt)
    assert info["compiled"] is False and info["mode"] is None and info["compile_s"] == 0.0
    assert set(info["failures"]) == set(peers.COMPILE_MODES)
    assert all("inductor fails" in why for why in info["failures"].values())
    before = w.detach().clone()
    w.grad = torch.randn(6, 4)
    opt.step()
    assert not torch.equal(w, before)


def test_the_step_cap_and_cadence_mean_the_same_data_at_every_batch_size(splits, monkeypatch):
    spec = TtrProblem(targets=(1.01,), max_steps=1500, eval_every=25)
    assert spec.at_batch(512, 128) == TtrProblem((1.01,), 375, 6)
    assert spec.at_batch(128, 128) == spec
    sizes = []
    original = protocol.timed_step

    def record(net, lossfunc, opt, collects, x, y, clock):
        sizes.append(len(y))
        return original(net, lossfunc, opt, collects, x, y, clock)

    monkeypatch.setattr(protocol, "timed_step", record)
    small = TtrProblem(targets=(1.01,), max_steps=8, eval_every=4, eval_size=200)
    run = train_to_targets(Setting("adam", 0.01, batch_size=512), "mnist_logreg", small, splits, 0)
    assert run.batch_size == 512 and run.max_steps == 2 and sizes == [512, 512]
    assert [s for s, _, _ in run.curve] == [0, 1, 2]  # every 4 steps of 128 = every step of 512


def _fake_run(setting, steps):
    run = RunResult(setting.as_dict(), 0, {"0.5": steps}, {"0.5": steps}, "reached")
    run.batch_size = setting.batch_size
    run.status = "reached" if steps is not None else "capped"
    return run


@pytest.mark.parametrize("cost_512, winner", [(3.0, 128), (2.0, 512)])
def test_batch_sizes_are_compared_in_time_and_pruned_within_their_own(
    splits, monkeypatch, cost_512, winner
):
    """At batch 128 the best setting needs 100 steps, at 512 40 steps: 512 wins when its step
    costs less than 2.5 of batch 128's."""
    steps = {(0.1, 128): 150, (0.2, 128): 100, (0.1, 512): 60, (0.2, 512): 40}
    calls, measured = [], []

    def fake(setting, problem, spec, splits, seed, prune_at=None):
        calls.append((setting.lr, setting.batch_size, seed, prune_at))
        return _fake_run(setting, steps[setting.lr, setting.batch_size])

    def costs(problem, settings, splits, rounds, warmup, log):
        measured.append({k: (s.lr, s.batch_size) for k, s in settings.items()})
        per_step = {128: 1.0, 512: cost_512}
        return {"entries": {k: {"per_step_s": per_step[s.batch_size]} for k, s in settings.items()}}

    monkeypatch.setattr(protocol, "train_to_targets", fake)
    monkeypatch.setattr(protocol, "measure_costs", costs)
    grid = tuple(Setting("adam", lr, batch_size=b) for b in (128, 512) for lr in (0.1, 0.2))
    entry = tune_and_run("mnist_logreg", grid, TtrProblem((0.5,), 100), splits, 2, log=len)
    assert [c[3] for c in calls[:4]] == [None, 150, None, 60]  # pruned by its own batch size
    assert measured == [{"1": (0.2, 128), "3": (0.2, 512)}]
    assert entry["batch_winners"] == {"128": 1, "512": 3}
    assert entry["candidate_costs"] == {"1": 1.0, "3": cost_512}
    assert entry["runs"][0]["batch_size"] == winner and calls[-1] == (0.2, winner, 1, None)


@pytest.mark.parametrize("cost_of_second, winner", [(0.5, 1), (2.0, 0)])
def test_settings_tied_in_steps_are_compared_in_cost(splits, monkeypatch, cost_of_second, winner):
    """Two settings of one batch size reach every target in the same steps: the cheaper step
    wins (the first in the grid where it is not cheaper); a slower setting is no candidate."""
    steps = {0.1: 100, 0.2: 100, 0.3: 150}
    measured = []

    def fake(setting, problem, spec, splits, seed, prune_at=None):
        return _fake_run(setting, steps[setting.lr])

    def costs(problem, settings, splits, rounds, warmup, log):
        measured.append(sorted(settings))
        per_step = {0.1: 1.0, 0.2: cost_of_second, 0.3: 0.1}
        return {"entries": {k: {"per_step_s": per_step[s.lr]} for k, s in settings.items()}}

    monkeypatch.setattr(protocol, "train_to_targets", fake)
    monkeypatch.setattr(protocol, "measure_costs", costs)
    grid = tuple(Setting("adam", lr, batch_size=128) for lr in (0.1, 0.2, 0.3))
    entry = tune_and_run("mnist_logreg", grid, TtrProblem((0.5,), 200), splits, 1, log=len)
    assert measured == [["0", "1"]]
    assert entry["winner"] == winner and entry["batch_winners"] == {"128": 0}


def test_vit_shapes_parameters_and_a_few_adam_steps():
    problem = get_problem("fmnist_vit")
    model = problem.model(seed=0)
    assert problem.input_shape == (1, 28, 28) and problem.dataset == "fmnist"
    names = dict(model.named_parameters())
    assert names["cls"].shape == (1, 1, 64) and names["pos"].shape == (1, 17, 64)
    assert names["patch.weight"].shape == (64, 1, 7, 7) and len(model.blocks) == 2
    # 64*49+64 patches, 64 + 17*64 tokens, 2 blocks (LayerNorms, qkv, proj, MLP), norm, head
    block = 2 * 128 + (64 * 192 + 192) + (64 * 64 + 64) + (64 * 128 + 128) + (128 * 64 + 64)
    assert sum(p.numel() for p in model.parameters()) == 3200 + 64 + 1088 + 2 * block + 128 + 650
    x = torch.rand(8, 1, 28, 28)
    y = torch.arange(8)
    assert model(x).shape == (8, 10)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = problem.loss()(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize("fallback", ["diagonal", "sgd"])
def test_kfac_with_a_fallback_for_the_raw_tokens_steps_the_vit(splits, fallback):
    spec = TtrProblem(targets=(1.01,), max_steps=3, eval_every=3, eval_size=200)
    setting = Setting("kfac", 0.01, 0.1, options=(("fallback", fallback),))
    run = train_to_targets(setting, "fmnist_vit", spec, splits, seed=0)
    assert run.steps == 3 and run.status == "capped"


def test_a_problem_without_targets_is_calibrated_by_adam_first(splits, monkeypatch, tmp_path):
    accuracies = {0.1: 0.8, 0.2: 0.9137, 0.3: 0.85}

    def fake(setting, problem, spec, splits, seed, prune_at=None):
        assert prune_at is None  # nothing to prune without targets
        run = RunResult(setting.as_dict(), seed, {}, {}, "capped")
        run.curve = [[0, 0.0, 0.1], [10, 1.0, accuracies[setting.lr]], [20, 2.0, 0.5]]
        return run

    real = protocol.train_to_targets
    monkeypatch.setattr(protocol, "train_to_targets", fake)
    grid = tuple(Setting("adam", lr) for lr in accuracies)
    entry = tune_and_run("fmnist_vit", grid, TtrProblem((), 100), splits, 1, log=len)
    assert entry["winner"] == 1 and entry["proposed_targets"] == [0.88, 0.9]
    assert summarize([entry], {}) == []  # a calibration entry is no row of the table

    monkeypatch.setattr(protocol, "train_to_targets", real)
    uncalibrated = replace(protocol.TTR_PROBLEMS["fmnist_vit"], targets=())
    monkeypatch.setitem(protocol.TTR_PROBLEMS, "fmnist_vit", uncalibrated)
    args = ["ttr", "--synthetic", "--problems", "fmnist_vit", "--json", str(tmp_path)]
    assert main(args + ["--optimizers", "kfac"]) == 2  # not before the targets are fixed
    quick = ["--quick", "--max-steps", "4", "--seeds", "1", "--batch-sizes", "128"]
    assert main(args + quick + ["--optimizers", "adam"]) == 0
    written = json.loads((tmp_path / "fmnist_vit_adam_calibration.json").read_text())
    assert len(written["tuning"]) == 4 and len(written["proposed_targets"]) == 2
    assert not (tmp_path / "fmnist_vit_adam.json").exists()


def test_the_committed_results_still_load_and_report():
    """Files written before the batch size was tuned read as batch 128, and a cost measured for
    such a setting counts for the same setting resumed with its batch size written."""
    entries = load_entries(RESULTS)
    old = [e for e in entries if e["problem"] == "mnist_logreg" and e["optimizer"] == "adam"]
    assert old and "batch_size" not in old[0]["tuning"][0]["setting"]
    rows = {(r["problem"], r["optimizer"]): r for r in summarize(entries, load_costs(RESULTS))}
    assert rows["mnist_logreg", "adam"]["batch_size"] == 128
    adam = rows["fmnist_2c2d", "adam"]
    assert adam["setting"]["batch_size"] == 128 and adam["steps"]["0.9"] == 525
    assert adam["cost_per_step_s"] > 0 and adam["est_ratio_to_adam"] == 1.0
    row = "| fmnist_2c2d | adam lr 0.004, warmup_cosine, batch 128 | 128 | 0.9 | 525 |"
    assert row in markdown_table(list(rows.values()))


def test_cost_blocks_use_each_entrys_own_batch_size(splits, monkeypatch):
    seen = []
    original = cost.timed_step

    def record(net, lossfunc, opt, collects, x, y, clock):
        seen.append((opt.param_groups[0]["lr"], len(y)))
        return original(net, lossfunc, opt, collects, x, y, clock)

    monkeypatch.setattr(cost, "timed_step", record)
    settings = {"128": Setting("adam", 0.01), "512": Setting("adam", 0.02, batch_size=512)}
    out = cost.measure_costs("mnist_logreg", settings, splits, rounds=1, warmup=0, log=len)
    assert {lr: n for lr, n in seen} == {0.01: 128, 0.02: 512} and len(seen) == 20
    assert {k: e["batch_size"] for k, e in out["entries"].items()} == {"128": 128, "512": 512}
