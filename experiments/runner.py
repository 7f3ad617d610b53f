"""Training runs and grid searches: one JSON per run, checkpoints every epoch, resumable.

A run's result file and checkpoint are named after its configuration, so a finished run is
skipped on restart and an interrupted one resumes from its last completed epoch.

Under ``torch.distributed`` with more than one rank (``torchrun --nproc_per_node=K``, see
:func:`experiments.distributed.init_distributed`), :func:`run` and :func:`grid` are
collective: every rank trains a ``DistributedDataParallel`` replica on its ``batch_size / K``
slice of each global mini-batch (the global batches are those of the single-process run),
evaluates a slice of each evaluation set, and the metrics are summed over the ranks; rank 0
alone writes checkpoints and JSON and shows progress. The results directory must be visible to
all ranks (one machine or a shared file system). With one process nothing of this is involved.
"""

from __future__ import annotations

import gc
import hashlib
import json
import statistics
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from .config import RunConfig
from .data import Splits, load_dataset, make_splits
from .distributed import check_distributable, dist_info, from_main, resolve_device
from .files import atomic_write
from .optimizers import DAMPED, SetupError
from .problems import get_problem
from .training import TrainingRun

#: The grid of the BackPACK paper (Dangel et al., 2020, Appendix).
PAPER_LRS = (1e-4, 1e-3, 1e-2, 1e-1, 1.0)
PAPER_DAMPINGS = (1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)


def load_splits(cfg: RunConfig, data_root: str | Path | None, device: torch.device) -> Splits:
    """Load (or synthesise) the problem's data set and split it, on ``device``."""
    data = load_dataset(get_problem(cfg.problem).dataset, data_root, cfg.synthetic)
    return make_splits(data, cfg.valid_size, cfg.train_size, cfg.eval_size, device)


def _engine_errors(collects: bool) -> tuple[type[Exception], ...]:
    """curvopt's own errors (module or loss not supported, ...), when its optimizers are used."""
    if not collects:
        return ()
    from curvopt.errors import CurvoptError

    return (CurvoptError,)


def result_path(cfg: RunConfig, results_dir: str | Path) -> Path:
    return Path(results_dir) / f"{cfg.name}.json"


def run(
    cfg: RunConfig,
    results_dir: str | Path = "results",
    data_root: str | Path | None = None,
    device: str = "auto",
    progress: bool = True,
    splits: Splits | None = None,
) -> dict:
    """Train ``cfg`` to the end (or divergence) and write its JSON; skip if it already exists.

    Collective under ``torch.distributed`` with more than one rank (see the module docstring):
    every rank returns rank 0's result.
    """
    info = dist_info()
    check_distributable(cfg, info)
    results_dir = Path(results_dir)
    out, ckpt = result_path(cfg, results_dir), results_dir / f"{cfg.name}.ckpt.pt"
    if not info.active:
        if out.exists():
            return {**json.loads(out.read_text()), "skipped": True}
        results_dir.mkdir(parents=True, exist_ok=True)
        resume = ckpt.exists()
    else:  # rank 0 decides, so that all ranks take the same path
        finished = None
        if info.main:
            finished = json.loads(out.read_text()) if out.exists() else None
            results_dir.mkdir(parents=True, exist_ok=True)
        finished, resume = from_main((finished, ckpt.exists() if info.main else None))
        if finished is not None:
            return {**finished, "skipped": True}
    dev = resolve_device(device)
    splits = splits if splits is not None else load_splits(cfg, data_root, dev)
    state = TrainingRun(cfg, splits, dev, progress, info)
    if resume:
        state.load(ckpt)
    else:
        state.history.append(state.eval_entry(0, None))
    try:
        status, diverged_epoch = state.train(ckpt)
    except _engine_errors(state.collects) as err:
        raise SetupError(f"{cfg.optimizer} cannot train {cfg.problem}: {err}") from err
    result = state.result(status, diverged_epoch)
    if info.main:
        atomic_write(out, lambda p: p.write_text(json.dumps(result, indent=1, allow_nan=False)))
        ckpt.unlink(missing_ok=True)
    if status == "diverged" and state.progress:
        tqdm.write(f"{state.label}: diverged in epoch {diverged_epoch}")
    if info.active:
        result = from_main(result)  # also: no rank returns before the JSON is written
        # DDP sits in a reference cycle; left to the interpreter's exit, after
        # destroy_process_group, it made gloo abort the process in about 1 of 4 runs
        del state
        gc.collect()
    return result


def _score(result: dict) -> float:
    """Final validation accuracy; diverged runs rank last."""
    acc = result["final"].get("valid_acc")
    return -1.0 if result["status"] != "finished" or acc is None else acc


def grid(
    base: RunConfig,
    lrs=PAPER_LRS,
    dampings=PAPER_DAMPINGS,
    seeds: int = 10,
    results_dir: str | Path = "results",
    data_root: str | Path | None = None,
    device: str = "auto",
    progress: bool = True,
) -> dict:
    """The paper's protocol: search (lr, damping) with ``base.seed``, pick the best final
    validation accuracy, rerun it with seeds ``0..seeds-1``; writes a summary JSON.

    Collective under ``torch.distributed`` (as :func:`run`); rank 0 writes the summary."""
    info = dist_info()
    progress = progress and info.main
    dev = resolve_device(device)
    splits = load_splits(base, data_root, dev)
    damping_values = dampings if base.optimizer in DAMPED else (None,)
    candidates = [replace(base, lr=lr, damping=d) for lr in lrs for d in damping_values]
    kwargs = {"results_dir": results_dir, "device": device, "progress": progress, "splits": splits}
    searched = [run(c, **kwargs) for c in tqdm(candidates, desc="grid", disable=not progress)]
    best_i = max(range(len(searched)), key=lambda i: _score(searched[i]))
    best = candidates[best_i]
    reruns = [run(replace(best, seed=s), **kwargs) for s in range(seeds)]
    finals = [r["final"]["test_acc"] for r in reruns if r["status"] == "finished"]
    summary = {
        "problem": base.problem,
        "optimizer": base.optimizer,
        "synthetic": splits.synthetic,
        "base_config": asdict(base),
        "search": [
            {
                "lr": c.lr,
                "damping": c.damping,
                "name": r["name"],
                "status": r["status"],
                "valid_acc": r["final"].get("valid_acc"),
                "test_acc": r["final"].get("test_acc"),
            }
            for c, r in zip(candidates, searched)
        ],
        "best": {"lr": best.lr, "damping": best.damping},
        "seeds": [
            {
                "seed": s,
                "name": r["name"],
                "status": r["status"],
                "test_acc": r["final"].get("test_acc"),
                "valid_acc": r["final"].get("valid_acc"),
            }
            for s, r in enumerate(reruns)
        ],
        "test_acc_mean": statistics.fmean(finals) if finals else None,
        "test_acc_std": statistics.stdev(finals) if len(finals) > 1 else None,
    }
    tag = "_synthetic" if splits.synthetic else ""
    fixed = {k: v for k, v in asdict(base).items() if k not in ("lr", "damping")}
    if base.preset is None and not base.options:  # the names of grids from before presets
        del fixed["preset"], fixed["options"]
    digest = hashlib.sha1(
        json.dumps([fixed, list(lrs), list(damping_values), seeds], sort_keys=True).encode()
    ).hexdigest()[:8]
    path = Path(results_dir) / f"grid_{base.problem}_{base.optimizer}_{digest}{tag}.json"
    if info.main:
        atomic_write(path, lambda p: p.write_text(json.dumps(summary, indent=1)))
    if info.active:
        dist.barrier()
    return {**summary, "path": str(path)}
