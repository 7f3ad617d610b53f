"""Training runs and grid searches: one JSON per run, checkpoints every epoch, resumable.

A run's result file and checkpoint are named after its configuration, so a finished run is
skipped on restart and an interrupted one resumes from its last completed epoch.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .data import (
    VALID_SIZE,
    Splits,
    eval_batches,
    load_dataset,
    make_splits,
    num_train_batches,
    train_batches,
)
from .problems import Problem, get_problem

#: name -> (class in ``curvopt.optim`` or None for torch.optim, fixed keyword arguments)
OPTIMIZERS: dict[str, tuple[str | None, dict]] = {
    "momentum": (None, {"momentum": 0.9}),
    "adam": (None, {}),
    "diagggn": ("DiagGGNNewton", {"curvature": "exact"}),
    "diagggn_mc": ("DiagGGNNewton", {"curvature": "mc"}),
    "kfac": ("KFAC", {"curvature": "kfac"}),
    "kflr": ("KFAC", {"curvature": "kflr"}),
    "kfra": ("KFAC", {"curvature": "kfra"}),
    "vsgd": ("VarianceAdaptedSGD", {}),
}
DAMPED = {"diagggn", "diagggn_mc", "kfac", "kflr", "kfra"}

#: The grid of the BackPACK paper (Dangel et al., 2020, Appendix).
PAPER_LRS = (1e-4, 1e-3, 1e-2, 1e-1, 1.0)
PAPER_DAMPINGS = (1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)


@dataclass(frozen=True)
class RunConfig:
    """Everything that determines a run's numbers (the device does not enter its name)."""

    problem: str
    optimizer: str
    lr: float
    damping: float | None = None
    seed: int = 0
    epochs: int | None = None
    batch_size: int | None = None
    train_size: int | None = None
    eval_size: int | None = None
    valid_size: int = VALID_SIZE
    augment: bool | None = None
    synthetic: bool = False

    def __post_init__(self):
        problem = get_problem(self.problem)
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"unknown optimizer {self.optimizer!r}; choose from {', '.join(OPTIMIZERS)}"
            )
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if self.optimizer in DAMPED and (self.damping is None or self.damping < 0):
            raise ValueError(f"{self.optimizer} needs a damping >= 0 (--damping)")
        if self.optimizer not in DAMPED and self.damping is not None:
            raise ValueError(f"{self.optimizer} takes no damping")
        # Fill in the problem's defaults so that equal runs get equal names.
        defaults = {
            "epochs": problem.epochs,
            "batch_size": problem.batch_size,
            "augment": problem.augment,
        }
        for key, value in defaults.items():
            if getattr(self, key) is None:
                object.__setattr__(self, key, value)
        if self.epochs < 1 or self.batch_size < 1:
            raise ValueError("epochs and batch_size must be >= 1")
        if self.train_size is not None and self.train_size < self.batch_size:
            raise ValueError(
                f"train_size {self.train_size} is smaller than one batch ({self.batch_size})"
            )

    @property
    def name(self) -> str:
        """Readable, deterministic file name stem: key settings plus a hash of all of them."""
        digest = hashlib.sha1(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:8]
        damping = "" if self.damping is None else f"_damp{self.damping:g}"
        tag = "_synthetic" if self.synthetic else ""
        return (
            f"{self.problem}_{self.optimizer}_lr{self.lr:g}{damping}_seed{self.seed}_{digest}{tag}"
        )


class SetupError(RuntimeError):
    """A run cannot start: its optimizer or device is not available."""


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SetupError(f"device {device!r} requested but torch sees no CUDA device")
    return dev


def load_splits(cfg: RunConfig, data_root: str | Path | None, device: torch.device) -> Splits:
    """Load (or synthesise) the problem's data set and split it, on ``device``."""
    data = load_dataset(get_problem(cfg.problem).dataset, data_root, cfg.synthetic)
    return make_splits(data, cfg.valid_size, cfg.train_size, cfg.eval_size, device)


def make_optimizer(
    cfg: RunConfig, problem: Problem, model: torch.nn.Module, lossfunc: torch.nn.Module
) -> tuple[torch.optim.Optimizer, bool]:
    """Build the optimizer; for curvopt optimizers also extend model and loss.

    Returns the optimizer and whether its backward pass must run inside ``opt.collect()``.
    """
    cls_name, kwargs = OPTIMIZERS[cfg.optimizer]
    groups = problem.param_groups(model)
    if cls_name is None:
        cls = torch.optim.SGD if cfg.optimizer == "momentum" else torch.optim.Adam
        return cls(groups, lr=cfg.lr, **kwargs), False
    try:
        import curvopt
        import curvopt.optim

        cls = getattr(curvopt.optim, cls_name)
    except (ImportError, AttributeError) as err:
        raise SetupError(
            f"optimizer {cfg.optimizer!r} needs curvopt.optim.{cls_name}, "
            f"which is not available: {err}"
        ) from err
    if cfg.damping is not None:
        kwargs = {**kwargs, "damping": cfg.damping}
    curvopt.extend(model)
    curvopt.extend(lossfunc)
    opt = cls(groups, lr=cfg.lr, **kwargs)
    if problem.weight_decay and "weight_decay" not in opt.defaults:
        raise SetupError(
            f"{cls_name} has no weight_decay; {problem.name} needs "
            f"{problem.weight_decay} on its weights"
        )
    return opt, True


class _Clock:
    """Wall-clock seconds, waiting for queued GPU work first."""

    def __init__(self, device: torch.device):
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def __call__(self) -> float:
        self.sync()
        return time.perf_counter()


@torch.no_grad()
def evaluate(model, lossfunc, splits: Splits, batch_size: int, prep) -> dict[str, float]:
    """Mean loss and accuracy on the train-eval, validation and test splits (eval mode)."""
    model.eval()
    out = {}
    for key in ("train", "valid", "test"):
        split = splits.train_eval if key == "train" else getattr(splits, key)
        loss_sum, correct = 0.0, 0
        for x, y in eval_batches(split, batch_size, prep):
            logits = model(x)
            loss_sum += lossfunc(logits, y).item() * len(y)
            correct += (logits.argmax(1) == y).sum().item()
        out[f"{key}_loss"] = loss_sum / len(split)
        out[f"{key}_acc"] = correct / len(split)
    model.train()
    return out


def _finite(x):
    """JSON-safe: non-finite floats become None."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


class _Run:
    """State of one run: model, optimizer, data and its history so far."""

    def __init__(self, cfg: RunConfig, splits: Splits, device: torch.device, progress: bool):
        self.cfg, self.splits, self.device, self.progress = cfg, splits, device, progress
        self.problem = get_problem(cfg.problem)
        self.prep = self.problem.preprocess(cfg.augment)
        torch.manual_seed(cfg.seed)
        self.model = self.problem.model(cfg.seed, device)
        self.lossfunc = self.problem.loss()
        self.opt, self.collects = make_optimizer(cfg, self.problem, self.model, self.lossfunc)
        self.data_gen = torch.Generator().manual_seed(cfg.seed)
        self.history: list[dict] = []
        self.resumed_at: list[int] = []
        self.clock = _Clock(device)
        self.label = cfg.name + (" [SYNTHETIC DATA]" if splits.synthetic else "")

    # --- checkpoints -------------------------------------------------------------------------
    def save(self, path: Path) -> None:
        state = {
            "history": self.history,
            "resumed_at": self.resumed_at,
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "data_rng": self.data_gen.get_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if self.device.type == "cuda" else [],
        }
        _atomic_write(path, lambda p: torch.save(state, p))

    def load(self, path: Path) -> None:
        state = torch.load(path, map_location=self.device, weights_only=True)
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"].cpu())
        self.data_gen.set_state(state["data_rng"].cpu())
        if state["cuda_rng"] and self.device.type == "cuda":
            torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda_rng"]])
        self.history = state["history"]
        self.resumed_at = state["resumed_at"] + [len(self.history) - 1]

    # --- training ----------------------------------------------------------------------------
    def train_epoch(self, epoch: int) -> dict:
        """One pass over the training split; stops early at the first non-finite loss."""
        cfg, clock = self.cfg, self.clock
        times = dict.fromkeys(("forward_s", "backward_s", "step_s"), 0.0)
        loss_sum, correct, seen, diverged = 0.0, 0, 0, False
        n_batches = num_train_batches(self.splits.train, cfg.batch_size)
        bar = tqdm(
            train_batches(self.splits.train, cfg.batch_size, self.prep, self.data_gen),
            total=n_batches,
            desc=f"{self.label} epoch {epoch}/{cfg.epochs}",
            leave=False,
            disable=not self.progress,
            dynamic_ncols=True,
        )
        start = clock()
        for x, y in bar:
            t0 = clock()
            self.opt.zero_grad()
            logits = self.model(x)
            loss = self.lossfunc(logits, y)
            t1 = clock()
            if self.collects:
                with self.opt.collect():
                    loss.backward()
            else:
                loss.backward()
            t2 = clock()
            self.opt.step()
            t3 = clock()
            times["forward_s"] += t1 - t0
            times["backward_s"] += t2 - t1
            times["step_s"] += t3 - t2
            value = loss.item()
            if not math.isfinite(value):
                diverged = True
                break
            loss_sum += value * len(y)
            correct += (logits.argmax(1) == y).sum().item()
            seen += len(y)
            bar.set_postfix(
                loss=f"{loss_sum / seen:.4f}", acc=f"{correct / seen:.3f}", refresh=False
            )
        bar.close()
        times["epoch_s"] = clock() - start
        return {
            "minibatch_loss": loss_sum / seen if seen else float("nan"),
            "minibatch_acc": correct / seen if seen else float("nan"),
            "diverged": diverged,
            "time": times,
        }

    def eval_entry(self, epoch: int, train_stats: dict | None) -> dict:
        t0 = self.clock()
        metrics = evaluate(self.model, self.lossfunc, self.splits, self.cfg.batch_size, self.prep)
        entry = {"epoch": epoch, **metrics}
        if train_stats is not None:
            entry.update(
                minibatch_loss=train_stats["minibatch_loss"],
                minibatch_acc=train_stats["minibatch_acc"],
                time=train_stats["time"],
            )
        entry.setdefault("time", {})["eval_s"] = self.clock() - t0
        return entry

    def train(self, ckpt: Path) -> tuple[str, int | None]:
        """Train the remaining epochs, checkpointing after each; returns status and bad epoch."""
        for epoch in range(len(self.history), self.cfg.epochs + 1):
            stats = self.train_epoch(epoch)
            if stats["diverged"]:
                return "diverged", epoch
            entry = self.eval_entry(epoch, stats)
            self.history.append(entry)
            _log(self, entry)
            if not math.isfinite(entry["train_loss"]):
                return "diverged", epoch
            self.save(ckpt)
        return "finished", None

    def result(self, status: str, diverged_epoch: int | None) -> dict:
        cfg = self.cfg
        trained = [h["time"] for h in self.history[1:]]
        total = {
            k: sum(t.get(k, 0.0) for t in trained)
            for k in ("epoch_s", "forward_s", "backward_s", "step_s")
        }
        total["eval_s"] = sum(h["time"]["eval_s"] for h in self.history)
        total["update_s"] = total["backward_s"] + total["step_s"]
        return _finite(
            {
                "name": cfg.name,
                "status": status,
                "synthetic": self.splits.synthetic,
                "config": asdict(cfg),
                "problem": {
                    "dataset": self.problem.dataset,
                    "weight_decay": self.problem.weight_decay,
                    "num_params": sum(p.numel() for p in self.model.parameters()),
                    "train_samples": len(self.splits.train),
                    "valid_samples": len(self.splits.valid),
                    "test_samples": len(self.splits.test),
                },
                "backward_in_collect": self.collects,
                "diverged_epoch": diverged_epoch,
                "resumed_at_epochs": self.resumed_at,
                "final": self.history[-1],
                "history": self.history,
                "timing": total,
                "timing_note": (
                    "update_s = backward_s + step_s; for curvature optimizers the backward "
                    "runs inside opt.collect(), so update_s includes the curvature work; "
                    "compare with a momentum run for the plain cost"
                ),
                "device": str(self.device),
                "torch": torch.__version__,
                "python": platform.python_version(),
            }
        )


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
    """Train ``cfg`` to the end (or divergence) and write its JSON; skip if it already exists."""
    results_dir = Path(results_dir)
    out, ckpt = result_path(cfg, results_dir), results_dir / f"{cfg.name}.ckpt.pt"
    if out.exists():
        return {**json.loads(out.read_text()), "skipped": True}
    results_dir.mkdir(parents=True, exist_ok=True)
    dev = resolve_device(device)
    splits = splits if splits is not None else load_splits(cfg, data_root, dev)
    state = _Run(cfg, splits, dev, progress)
    if ckpt.exists():
        state.load(ckpt)
    else:
        state.history.append(state.eval_entry(0, None))
    try:
        status, diverged_epoch = state.train(ckpt)
    except _engine_errors(state.collects) as err:
        raise SetupError(f"{cfg.optimizer} cannot train {cfg.problem}: {err}") from err
    result = state.result(status, diverged_epoch)
    _atomic_write(out, lambda p: p.write_text(json.dumps(result, indent=1, allow_nan=False)))
    ckpt.unlink(missing_ok=True)
    if status == "diverged" and progress:
        tqdm.write(f"{state.label}: diverged in epoch {diverged_epoch}")
    return result


def _log(state: _Run, e: dict) -> None:
    if state.progress:
        tqdm.write(
            f"{state.label} epoch {e['epoch']}: train loss {e['train_loss']:.4f} "
            f"acc {e['train_acc']:.4f} | valid acc {e['valid_acc']:.4f} | test acc "
            f"{e['test_acc']:.4f} | {e['time']['epoch_s']:.1f}s "
            f"(+{e['time']['eval_s']:.1f}s eval)"
        )


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
    validation accuracy, rerun it with seeds ``0..seeds-1``; writes a summary JSON."""
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
    digest = hashlib.sha1(
        json.dumps([fixed, list(lrs), list(damping_values), seeds], sort_keys=True).encode()
    ).hexdigest()[:8]
    path = Path(results_dir) / f"grid_{base.problem}_{base.optimizer}_{digest}{tag}.json"
    _atomic_write(path, lambda p: p.write_text(json.dumps(summary, indent=1)))
    return {**summary, "path": str(path)}
