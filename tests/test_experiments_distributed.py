"""The experiments runner on 2 gloo ranks (DDP) against one process on the same global batches.

One ``torch.multiprocessing.spawn`` of 2 ranks (``distributed_harness``) runs every scenario
(start-up, mostly importing torch, dominates): momentum, exact diagonal GGN, KFLR and vsgd
(deterministic, so the 2-rank run must match one process up to float32 rounding), a Monte-Carlo
KFAC run interrupted and resumed (per-rank random streams restored), an indivisible batch size
refused. One ``torchrun --standalone --nproc_per_node=2 -m experiments run ...`` checks the
command line end to end.
All on synthetic MNIST (random images), a 128-sample training subset, batch 32 (16 per rank).
A diverging run and a small grid check that the ranks decide alike and only rank 0 writes.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distributed_harness import run_rank, spawn_ranks
from experiments import files, runner, training
from experiments.config import RunConfig
from experiments.optimizers import SetupError
from experiments.runner import run

WORLD = 2
#: eval_size 63: the ranks evaluate slices of unequal size (32 and 31)
SMALL = {"batch_size": 32, "train_size": 128, "eval_size": 63, "synthetic": True}
#: deterministic optimizers: the 2-rank run must equal one process on the same global batches
CONFIGS = {
    "momentum": RunConfig("mnist_logreg", "momentum", 0.1, epochs=2, **SMALL),
    "diagggn": RunConfig("mnist_logreg", "diagggn", 0.1, damping=0.1, epochs=2, **SMALL),
    "kflr": RunConfig("mnist_logreg", "kflr", 0.1, damping=0.1, epochs=2, **SMALL),
    "vsgd": RunConfig("mnist_logreg", "vsgd", 0.1, epochs=2, **SMALL),
}
#: Monte-Carlo curvature: each rank draws its own samples; interrupted in epoch 2 and resumed
RESUME = RunConfig("mnist_logreg", "kfac", 0.05, damping=1e-2, epochs=3, **SMALL)
METRICS = ("train_loss", "train_acc", "valid_loss", "valid_acc", "test_loss", "test_acc")
TOL = 1e-5  # float32: metrics rel. and abs.; parameters relative to max(1, max |θ|)
REPO = Path(__file__).resolve().parents[1]


def _record_params(out: Path, tag: str) -> None:
    """Make ``_Run.result`` save the final parameters to ``out/<name>.<tag>.pt``."""
    original = training.TrainingRun.result

    def result(self, status, diverged_epoch):
        params = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        torch.save(params, out / f"{self.cfg.name}.{tag}.pt")
        return original(self, status, diverged_epoch)

    training.TrainingRun.result = result


@contextlib.contextmanager
def _recording_batches(name: str, log: list):
    """Log ``[size, sum of labels, sum of inputs]`` of every batch ``training.<name>`` yields."""
    original = getattr(training, name)

    def recording(*args, **kwargs):
        for x, y in original(*args, **kwargs):
            log.append([len(y), int(y.sum()), float(x.double().sum())])
            yield x, y

    setattr(training, name, recording)
    try:
        yield log
    finally:
        setattr(training, name, original)


def _scenarios(rank: int, out: Path) -> dict:
    report: dict = {"results": {}}
    writes: list[str] = []
    atomic_write = files.atomic_write
    for module in (runner, training):
        module.atomic_write = lambda path, write: (
            writes.append(path.name) or atomic_write(path, write)
        )
    _record_params(out, f"rank{rank}")
    cpu = torch.device("cpu")
    splits = runner.load_splits(CONFIGS["momentum"], None, cpu)
    kw = {"device": "cpu", "splits": splits}

    for key, cfg in CONFIGS.items():
        err, batches = io.StringIO(), []
        with contextlib.redirect_stderr(err), _recording_batches("shard", batches):
            result = run(cfg, out / "runs", progress=key == "momentum", **kw)
        report.setdefault("batches", {})[key] = batches
        report["results"][key] = result
        if key == "momentum":
            report["progress"] = err.getvalue()
    report["skipped"] = run(CONFIGS["momentum"], out / "runs", progress=False, **kw).get("skipped")
    report["writes"] = list(writes)  # before the scenarios below

    # interrupted in epoch 2 on both ranks (before its checkpoint), then resumed
    straight = run(RESUME, out / "straight", progress=False, **kw)
    eval_entry = training.TrainingRun.eval_entry

    def crash_in_epoch_2(self, epoch, stats):
        if epoch == 2:
            raise KeyboardInterrupt
        return eval_entry(self, epoch, stats)

    training.TrainingRun.eval_entry = crash_in_epoch_2
    with contextlib.suppress(KeyboardInterrupt):
        run(RESUME, out / "resumed", progress=False, **kw)
    training.TrainingRun.eval_entry = eval_entry
    dist.barrier()
    if rank == 0:
        ckpt = torch.load(out / "resumed" / f"{RESUME.name}.ckpt.pt", weights_only=True)
        report["ckpt"] = {
            "world_size": ckpt["world_size"],
            "ranks": len(ckpt["rank_rng"]),
            "rng_differ": not torch.equal(
                ckpt["rank_rng"][0]["torch_rng"], ckpt["rank_rng"][1]["torch_rng"]
            ),
        }
        shutil.copy(out / "resumed" / f"{RESUME.name}.ckpt.pt", out / "two_ranks.ckpt.pt")
    resumed = run(RESUME, out / "resumed", progress=False, **kw)
    report["resume"] = {"straight": straight, "resumed": resumed}

    # divergence (decided on the all-reduced loss) and a grid: same outcome on every rank
    start = len(writes)
    wild = RunConfig("mnist_logreg", "momentum", 1e37, epochs=2, **SMALL)
    report["diverged"] = run(wild, out / "wild", progress=False, **kw)
    base = RunConfig("mnist_logreg", "momentum", 0.1, epochs=1, **SMALL)
    summary = runner.grid(base, lrs=(0.1, 1e37), seeds=1, results_dir=out / "grid", device="cpu")
    report["grid"] = summary
    report["late_writes"] = writes[start:]

    odd = RunConfig("mnist_logreg", "momentum", 0.1, epochs=1, **{**SMALL, "batch_size": 33})
    try:
        run(odd, out / "odd", progress=False, **kw)
        report["odd"] = "no error"
    except SetupError as error:
        report["odd"] = str(error)
    return report


def _worker(rank: int, world: int, outdir: str) -> None:
    torch.set_num_threads(1)
    run_rank(rank, world, outdir, lambda rank, world: _scenarios(rank, Path(outdir)))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    return out, spawn_ranks(WORLD, str(out), _worker)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One process on the same global batches: results and final parameters."""
    out = tmp_path_factory.mktemp("single")
    original = training.TrainingRun.result
    _record_params(out, "single")
    try:
        splits = runner.load_splits(CONFIGS["momentum"], None, torch.device("cpu"))
        results, batches = {}, {}
        for key, cfg in CONFIGS.items():
            with _recording_batches("train_batches", batches.setdefault(key, [])):
                results[key] = run(cfg, out / "runs", device="cpu", progress=False, splits=splits)
    finally:
        training.TrainingRun.result = original
    return out, results, batches


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _scale(a: dict) -> float:
    return max(1.0, *(v.abs().max().item() for v in a.values()))


@pytest.mark.parametrize("key", list(CONFIGS))
def test_two_ranks_match_one_process(key, ranks, single):
    (out, reports), (ref_out, ref, ref_batches) = ranks, single
    name = CONFIGS[key].name
    # each rank trained on its half of every global batch of the single-process run
    shards = [report["batches"][key] for report in reports]
    assert len(shards[0]) == len(shards[1]) == len(ref_batches[key]) == 2 * 128 // 32
    for (n0, y0, x0), (n1, y1, x1), (n, y, x) in zip(*shards, ref_batches[key]):
        assert n0 == n1 == n // 2 == 16 and y0 + y1 == y
        assert x0 + x1 == pytest.approx(x, rel=1e-9) and x0 != x1
    params = [torch.load(out / f"{name}.rank{r}.pt", weights_only=True) for r in range(WORLD)]
    assert _max_diff(params[0], params[1]) == 0.0  # the replicas stay identical
    alone = torch.load(ref_out / f"{name}.single.pt", weights_only=True)
    assert _max_diff(params[0], alone) <= TOL * _scale(alone)

    got, want = reports[0]["results"][key], ref[key]
    assert reports[1]["results"][key] == got  # every rank returns rank 0's result
    assert got["status"] == want["status"] == "finished"
    assert got["world_size"] == 2 and want["world_size"] == 1
    assert got["distributed"]["batch_size_per_rank"] == 16
    assert got["distributed"]["backend"] == "gloo"
    assert got["backward_in_collect"] == want["backward_in_collect"]
    for g, w in zip(got["history"], want["history"], strict=True):
        keys = METRICS + (("minibatch_loss", "minibatch_acc") if g["epoch"] else ())
        assert [g[k] for k in keys] == pytest.approx([w[k] for k in keys], rel=TOL, abs=TOL)
    assert got["problem"] == want["problem"]
    on_disk = json.loads((out / "runs" / f"{name}.json").read_text())
    assert on_disk == got


def test_only_rank_0_writes_and_shows_progress(ranks):
    out, reports = ranks
    names = [cfg.name for cfg in CONFIGS.values()]
    assert reports[1]["writes"] == []
    json_writes = [w for w in reports[0]["writes"] if w.endswith(".json")]
    assert json_writes == [f"{n}.json" for n in names]  # each JSON written once
    ckpt_writes = [w for w in reports[0]["writes"] if w.endswith(".ckpt.pt")]
    assert ckpt_writes == [f"{n}.ckpt.pt" for n in names for _ in range(2)]  # once per epoch
    assert sorted(p.name for p in (out / "runs").iterdir()) == sorted(f"{n}.json" for n in names)
    assert reports[0]["skipped"] is True and reports[1]["skipped"] is True
    assert "epoch 1" in reports[0]["progress"] and reports[1]["progress"] == ""


def test_resume_on_two_ranks_is_identical(ranks):
    _, reports = ranks
    assert reports[0]["ckpt"] == {"world_size": 2, "ranks": 2, "rng_differ": True}
    for report in reports:
        straight, resumed = report["resume"]["straight"], report["resume"]["resumed"]
        assert resumed["resumed_at_epochs"] == [1] and resumed["status"] == "finished"
        for g, w in zip(resumed["history"], straight["history"], strict=True):
            keys = METRICS + (("minibatch_loss",) if g["epoch"] else ())
            assert [g[k] for k in keys] == pytest.approx([w[k] for k in keys], rel=1e-6)


def test_checkpoint_of_two_ranks_refused_by_one_process(ranks, tmp_path):
    out, _ = ranks
    shutil.copy(out / "two_ranks.ckpt.pt", tmp_path / f"{RESUME.name}.ckpt.pt")
    with pytest.raises(SetupError, match="written by a run on 2 process"):
        run(RESUME, tmp_path, device="cpu", progress=False)


def test_divergence_and_grid_agree_on_all_ranks(ranks):
    out, reports = ranks
    assert reports[0]["diverged"] == reports[1]["diverged"]
    assert reports[0]["diverged"]["status"] == "diverged"
    assert reports[0]["diverged"]["diverged_epoch"] == 1
    assert reports[0]["grid"] == reports[1]["grid"]
    assert [r["status"] for r in reports[0]["grid"]["search"]] == ["finished", "diverged"]
    assert reports[0]["grid"]["best"] == {"lr": 0.1, "damping": None}
    assert reports[1]["late_writes"] == []
    assert sum(w.startswith("grid_") for w in reports[0]["late_writes"]) == 1
    assert Path(reports[0]["grid"]["path"]).is_file()


def test_refusals(ranks):
    _, reports = ranks
    for report in reports:
        assert "not divisible by the 2 ranks" in report["odd"]


def test_torchrun_command_line(single, tmp_path):
    """``torchrun --nproc_per_node=2 -m experiments run ...``: one JSON, one printed line."""
    _, ref, _ = single
    args = ["--epochs", "2", "--batch-size", "32", "--train-size", "128", "--eval-size", "63"]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={WORLD}",
        "--standalone",  # its agent binds a free port itself: no port to pick here
        "-m",
        "experiments",
        "run",
        "mnist_logreg",
        "momentum",
        "--lr",
        "0.1",
        "--synthetic",
        *args,
        "--device",
        "cpu",
        "--results-dir",
        str(tmp_path),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    name = CONFIGS["momentum"].name
    assert [p.name for p in tmp_path.iterdir()] == [f"{name}.json"]
    assert proc.stdout.count(f"{name}: finished") == 1  # rank 0 prints, rank 1 does not
    assert proc.stderr.count("epoch 2/2") >= 1  # rank 0's progress bar
    result = json.loads((tmp_path / f"{name}.json").read_text())
    assert result["world_size"] == 2 and result["synthetic"] is True
    want = ref["momentum"]["final"]
    assert [result["final"][k] for k in METRICS] == pytest.approx(
        [want[k] for k in METRICS], rel=TOL, abs=TOL
    )
