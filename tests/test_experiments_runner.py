"""The experiment runner end to end on a tiny MNIST written here: JSON, skip, resume, grid."""

import contextlib
import gzip
import json
import struct
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from experiments import runner, training
from experiments.__main__ import main
from experiments.config import RunConfig
from experiments.optimizers import SetupError, make_optimizer
from experiments.runner import grid, run

TINY = {"epochs": 1, "batch_size": 32, "valid_size": 100}


def _write_idx(path, array):
    header = struct.pack(">BBBB", 0, 0, 8, array.ndim) + b"".join(
        struct.pack(">I", d) for d in array.shape
    )
    path.write_bytes(gzip.compress(header + array.astype(np.uint8).tobytes()))


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    """300 training and 50 test images whose label is a visible blob, so they can be learned."""
    root = tmp_path_factory.mktemp("data")
    (root / "mnist").mkdir()
    rng = np.random.default_rng(0)
    for split, n in (("train", 300), ("t10k", 50)):
        labels = rng.integers(0, 10, n)
        images = rng.integers(0, 60, (n, 28, 28))
        for i, label in enumerate(labels):
            images[i, 2 * label : 2 * label + 4, 4:24] = 255
        _write_idx(root / "mnist" / f"{split}-images-idx3-ubyte.gz", images)
        _write_idx(root / "mnist" / f"{split}-labels-idx1-ubyte.gz", labels)
    return root


def _run(cfg, results, data_root, **kw):
    return run(cfg, results, data_root, device="cpu", progress=False, **kw)


def test_config_names_and_validation():
    a = RunConfig("mnist_logreg", "momentum", 0.1)
    assert a.epochs == 50 and a.batch_size == 128 and a.augment is False
    assert a.name == RunConfig("mnist_logreg", "momentum", 0.1, epochs=50).name
    assert a.name != RunConfig("mnist_logreg", "momentum", 0.1, seed=1).name
    assert RunConfig("mnist_logreg", "kfac", 0.1, damping=1e-3).name.startswith(
        "mnist_logreg_kfac_lr0.1_damp0.001_seed0_"
    )
    assert RunConfig("mnist_logreg", "adam", 0.1, synthetic=True).name.endswith("_synthetic")
    with pytest.raises(ValueError, match="needs a damping"):
        RunConfig("mnist_logreg", "kfac", 0.1)
    with pytest.raises(ValueError, match="takes no damping"):
        RunConfig("mnist_logreg", "momentum", 0.1, damping=1.0)
    with pytest.raises(ValueError, match="unknown optimizer"):
        RunConfig("mnist_logreg", "lbfgs", 0.1)


def test_one_epoch_end_to_end(tmp_path, data_root):
    cfg = RunConfig("mnist_logreg", "momentum", 0.1, **TINY)
    result = _run(cfg, tmp_path, data_root)
    on_disk = json.loads((tmp_path / f"{cfg.name}.json").read_text())
    assert on_disk == result and not list(tmp_path.glob("*.ckpt.pt"))
    assert result["status"] == "finished" and result["synthetic"] is False
    assert [h["epoch"] for h in result["history"]] == [0, 1]
    final = result["final"]
    assert final["train_acc"] > 0.5 and 0 <= final["test_acc"] <= 1
    assert result["problem"]["train_samples"] == 200 and result["problem"]["test_samples"] == 50
    assert set(final["time"]) == {"forward_s", "backward_s", "step_s", "epoch_s", "eval_s"}
    assert result["timing"]["update_s"] > 0 and result["backward_in_collect"] is False


def test_finished_run_is_skipped(tmp_path, data_root):
    cfg = RunConfig("mnist_logreg", "adam", 1e-3, **TINY)
    _run(cfg, tmp_path, data_root)
    stamp = (tmp_path / f"{cfg.name}.json").stat().st_mtime_ns
    again = _run(cfg, tmp_path, data_root)
    assert again["skipped"] and (tmp_path / f"{cfg.name}.json").stat().st_mtime_ns == stamp


def test_interrupted_run_resumes(tmp_path, data_root, monkeypatch):
    cfg = RunConfig("mnist_logreg", "momentum", 0.05, **{**TINY, "epochs": 3})
    reference = _run(cfg, tmp_path / "straight", data_root)

    original_eval, trained = training.TrainingRun.eval_entry, []

    def crash_in_epoch_2(self, epoch, stats):
        if epoch == 2:
            raise KeyboardInterrupt
        return original_eval(self, epoch, stats)

    monkeypatch.setattr(training.TrainingRun, "eval_entry", crash_in_epoch_2)
    with pytest.raises(KeyboardInterrupt):
        _run(cfg, tmp_path, data_root)
    assert (tmp_path / f"{cfg.name}.ckpt.pt").exists()
    assert not (tmp_path / f"{cfg.name}.json").exists()

    monkeypatch.setattr(training.TrainingRun, "eval_entry", original_eval)
    original_train = training.TrainingRun.train_epoch
    monkeypatch.setattr(
        training.TrainingRun,
        "train_epoch",
        lambda self, epoch: trained.append(epoch) or original_train(self, epoch),
    )
    resumed = _run(cfg, tmp_path, data_root)
    assert trained == [2, 3] and resumed["resumed_at_epochs"] == [1]
    for got, want in zip(resumed["history"], reference["history"]):
        keys = [k for k in ("train_loss", "valid_acc", "test_loss", "minibatch_loss") if k in want]
        assert [got[k] for k in keys] == pytest.approx([want[k] for k in keys], rel=1e-6)
    assert not (tmp_path / f"{cfg.name}.ckpt.pt").exists()


def test_diverged_run_is_recorded(tmp_path, data_root):
    cfg = RunConfig("mnist_logreg", "momentum", 1e37, **{**TINY, "epochs": 2})
    result = _run(cfg, tmp_path, data_root)
    assert result["status"] == "diverged" and result["diverged_epoch"] == 1
    json.loads((tmp_path / f"{cfg.name}.json").read_text())  # still valid JSON


def test_grid_picks_best_and_reruns_seeds(tmp_path, data_root):
    base = RunConfig("mnist_logreg", "momentum", 1.0, **TINY)
    summary = grid(
        base,
        lrs=(1e-4, 0.1, 1e37),
        seeds=2,
        results_dir=tmp_path,
        data_root=data_root,
        device="cpu",
        progress=False,
    )
    assert [r["status"] for r in summary["search"]] == ["finished", "finished", "diverged"]
    assert summary["best"] == {"lr": 0.1, "damping": None}
    assert [s["seed"] for s in summary["seeds"]] == [0, 1]
    assert summary["seeds"][0]["name"] == summary["search"][1]["name"]  # seed 0 reused
    assert (
        json.loads(Path(summary["path"]).read_text())["test_acc_mean"] == summary["test_acc_mean"]
    )


def test_cli_synthetic_marks_every_output(tmp_path, capsys):
    args = [
        "run",
        "mnist_logreg",
        "momentum",
        "--lr",
        "0.1",
        "--synthetic",
        "--epochs",
        "1",
        "--batch-size",
        "32",
        "--train-size",
        "64",
        "--eval-size",
        "32",
        "--device",
        "cpu",
        "--data-root",
        str(tmp_path / "nothing"),
        "--results-dir",
        str(tmp_path),
    ]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert "SYNTHETIC" in out and "SYNTHETIC" in err  # table line and progress output
    (result_file,) = tmp_path.glob("*.json")
    assert result_file.name.endswith("_synthetic.json")
    assert json.loads(result_file.read_text())["synthetic"] is True


def test_cli_missing_data_fails_clearly(tmp_path, capsys):
    args = [
        "run",
        "mnist_logreg",
        "momentum",
        "--lr",
        "0.1",
        "--data-root",
        str(tmp_path),
        "--results-dir",
        str(tmp_path / "res"),
        "--no-progress",
    ]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "MNIST not found" in err and "--synthetic" in err and "fetch_data" in err


@pytest.fixture
def fake_curvopt(monkeypatch):
    """A stand-in ``curvopt`` that records how the runner uses the documented API."""
    calls = {"extended": [], "collected": 0, "inside": False}

    class FakeKFAC(torch.optim.SGD):
        def __init__(self, params, lr, damping, curvature, weight_decay=0.0):
            super().__init__(params, lr=lr, weight_decay=weight_decay)
            self.curvature, self.damping = curvature, damping

        @contextlib.contextmanager
        def collect(self):
            calls["inside"] = True
            yield
            calls["inside"], calls["collected"] = False, calls["collected"] + 1

        def step(self, closure=None):
            assert not calls["inside"], "step must come after the collect block"
            return super().step(closure)

    class NoDecay(torch.optim.SGD):
        def __init__(self, params, lr):
            super().__init__(params, lr=lr)
            del self.defaults["weight_decay"]

    optim = types.ModuleType("curvopt.optim")
    optim.KFAC, optim.VarianceAdaptedSGD = FakeKFAC, NoDecay
    errors = types.ModuleType("curvopt.errors")
    errors.CurvoptError = type("CurvoptError", (Exception,), {})
    fake = types.ModuleType("curvopt")
    fake.optim, fake.errors = optim, errors
    fake.extend = lambda m: calls["extended"].append(m) or m
    for name, module in (("curvopt", fake), ("curvopt.optim", optim), ("curvopt.errors", errors)):
        monkeypatch.setitem(sys.modules, name, module)
    return calls


def test_curvature_optimizer_uses_extend_and_collect(tmp_path, data_root, fake_curvopt):
    cfg = RunConfig("mnist_logreg", "kflr", 0.1, damping=1e-2, **TINY)
    result = _run(cfg, tmp_path, data_root)
    assert result["backward_in_collect"] is True and result["status"] == "finished"
    assert fake_curvopt["collected"] == 200 // 32
    kinds = [type(m).__name__ for m in fake_curvopt["extended"]]
    assert kinds == ["Sequential", "CrossEntropyLoss"]


def test_curvature_optimizer_setup_errors(fake_curvopt, monkeypatch):
    problem = runner.get_problem("cifar10_3c3d")
    model, loss = problem.model(0), problem.loss()
    with pytest.raises(SetupError, match="no weight_decay"):
        make_optimizer(RunConfig("cifar10_3c3d", "vsgd", 0.1), problem, model, loss)
    monkeypatch.delattr(sys.modules["curvopt.optim"], "KFAC")
    with pytest.raises(SetupError, match="needs curvopt.optim.KFAC"):
        make_optimizer(RunConfig("cifar10_3c3d", "kfac", 0.1, damping=1.0), problem, model, loss)


def test_unsupported_by_the_engine_fails_clearly(tmp_path, data_root, fake_curvopt, monkeypatch):
    error = sys.modules["curvopt.errors"].CurvoptError

    def refuse(self):
        raise error("module '0' (Conv2d): KFRA is not implemented for it")

    monkeypatch.setattr(sys.modules["curvopt.optim"].KFAC, "collect", refuse)
    cfg = RunConfig("mnist_logreg", "kfra", 0.1, damping=1e-2, **TINY)
    with pytest.raises(SetupError, match="kfra cannot train mnist_logreg: module '0'"):
        _run(cfg, tmp_path, data_root)
    assert not list(tmp_path.glob("*.json"))


def test_schedule_free_is_evaluated_at_its_average(tmp_path, data_root, monkeypatch):
    """``run`` evaluates schedule-free AdamW in its ``eval()`` mode (the averaged weights ``x``),
    and training resumes from its own parameters after."""
    pytest.importorskip("schedulefree")
    modes, original = [], training.evaluate

    def evaluate(model, *args, **kwargs):
        modes.append([g["train_mode"] for g in run_state["opt"].param_groups])
        return original(model, *args, **kwargs)

    run_state = {}
    original_init = training.TrainingRun.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        run_state["opt"] = self.opt

    monkeypatch.setattr(training, "evaluate", evaluate)
    monkeypatch.setattr(training.TrainingRun, "__init__", init)
    result = _run(RunConfig("mnist_logreg", "sf_adamw", 0.01, **TINY), tmp_path, data_root)
    assert result["status"] == "finished" and len(modes) == 2
    assert not any(train for mode in modes for train in mode), modes
    assert all(g["train_mode"] for g in run_state["opt"].param_groups)
