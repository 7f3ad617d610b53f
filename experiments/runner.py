"""Training runs and grid searches: one JSON per run, checkpoints every epoch, resumable.

A run's result file and checkpoint are named after its configuration, so a finished run is
skipped on restart and an interrupted one resumes from its last completed epoch.

Under ``torch.distributed`` with more than one rank (``torchrun --nproc_per_node=K``, see
:func:`init_distributed`), :func:`run` and :func:`grid` are collective: every rank trains a
``DistributedDataParallel`` replica on its ``batch_size / K`` slice of each global mini-batch (the
global batches are those of the single-process run), evaluates a slice of each evaluation set,
and the metrics are summed over the ranks; rank 0 alone writes checkpoints and JSON and shows
progress. The results directory must be visible to all ranks (one machine or a shared file
system). With one process nothing of this is involved.
"""

from __future__ import annotations

import gc
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
import torch.distributed as dist
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


# --- torch.distributed (torchrun) ------------------------------------------------------------

#: Offset between the ranks' seeds of the global generators (dropout, Monte-Carlo curvature).
RANK_SEED_STRIDE = 1_000_003


@dataclass(frozen=True)
class DistInfo:
    """Where this process stands in ``torch.distributed`` (one rank of one when not in use)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def active(self) -> bool:
        return self.world_size > 1

    @property
    def main(self) -> bool:
        return self.rank == 0


def dist_info() -> DistInfo:
    """The default process group if it is initialized with more than one rank, else one rank."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        rank = dist.get_rank()
        return DistInfo(rank, dist.get_world_size(), int(os.environ.get("LOCAL_RANK", rank)))
    return DistInfo()


def _rank_device(device: str, local_rank: int) -> torch.device:
    """The device of one rank: CUDA devices are ``cuda:LOCAL_RANK``."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev
    if not torch.cuda.is_available():
        raise SetupError(f"device {device!r} requested but torch sees no CUDA device")
    if dev.index is not None and dev.index != local_rank:
        raise SetupError(
            f"device {device!r}: under torchrun every rank uses cuda:LOCAL_RANK (here "
            f"cuda:{local_rank}); pass --device cuda (or auto)"
        )
    if local_rank >= torch.cuda.device_count():
        raise SetupError(
            f"local rank {local_rank} needs cuda:{local_rank}, but torch sees only "
            f"{torch.cuda.device_count()} CUDA device(s); start at most that many processes "
            "per node"
        )
    return torch.device("cuda", local_rank)


def init_distributed(device: str = "auto") -> bool:
    """Initialize the default process group when started by ``torchrun`` with ``WORLD_SIZE`` > 1.

    The backend is NCCL when the rank's device (see :func:`resolve_device`) is a CUDA device,
    else gloo; rank, world size and rendezvous come from torchrun's environment. Returns whether
    it initialized the group (the caller then calls ``torch.distributed.destroy_process_group``).
    Does nothing for one process or when the group is already initialized.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or (dist.is_available() and dist.is_initialized()):
        return False
    if not dist.is_available():
        raise SetupError("WORLD_SIZE > 1 but this torch build has no torch.distributed")
    dev = _rank_device(device, int(os.environ.get("LOCAL_RANK", "0")))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return True


def _from_main(obj):
    """Rank 0's ``obj`` on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _check_distributable(cfg: RunConfig, info: DistInfo) -> None:
    if not info.active:
        return
    if cfg.optimizer == "vsgd":
        raise SetupError(
            f"vsgd (VarianceAdaptedSGD) cannot run on {info.world_size} ranks: its per-sample "
            "gradient variance cannot be recovered from the ranks' averaged gradients, and each "
            "rank stepping with its own would desynchronize the replicas; run it in one process "
            "(python -m experiments run ..., without torchrun)"
        )
    if cfg.batch_size % info.world_size:
        raise SetupError(
            f"batch size {cfg.batch_size} is not divisible by the {info.world_size} ranks: each "
            "rank trains on batch_size / K samples of every global batch; choose --batch-size or "
            "--nproc_per_node so that K divides it"
        )


def _shard(batches, info: DistInfo):
    """This rank's contiguous slice of each global batch."""
    for x, y in batches:
        n = len(y) // info.world_size
        lo, hi = info.rank * n, (info.rank + 1) * n
        yield x[lo:hi], y[lo:hi]


def resolve_device(device: str) -> torch.device:
    """``device`` as a ``torch.device``; under torchrun with K > 1, CUDA means cuda:LOCAL_RANK."""
    info = dist_info()
    if info.active:
        return _rank_device(device, info.local_rank)
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
def evaluate(
    model, lossfunc, splits: Splits, batch_size: int, prep, info: DistInfo | None = None
) -> dict[str, float]:
    """Mean loss and accuracy on the train-eval, validation and test splits (eval mode).

    With ``info.active``, every rank evaluates a contiguous slice of each split and the sums are
    all-reduced (collective; every rank gets the same numbers).
    """
    if info is not None and info.active:
        return _evaluate_sharded(model, lossfunc, splits, batch_size, prep, info)
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


def _slice(split, lo: int, hi: int):
    return type(split)(split.x[lo:hi], split.y[lo:hi])


def _evaluate_sharded(model, lossfunc, splits, batch_size, prep, info) -> dict[str, float]:
    model.eval()
    keys, sums = ("train", "valid", "test"), []
    for key in keys:
        split = splits.train_eval if key == "train" else getattr(splits, key)
        n = len(split)
        part = _slice(
            split, n * info.rank // info.world_size, n * (info.rank + 1) // info.world_size
        )
        loss_sum, correct = 0.0, 0
        for x, y in eval_batches(part, batch_size, prep):
            logits = model(x)
            loss_sum += lossfunc(logits, y).item() * len(y)
            correct += (logits.argmax(1) == y).sum().item()
        sums += [loss_sum, float(correct)]
    model.train()
    device = next(model.parameters()).device
    total = torch.tensor(sums, dtype=torch.float64, device=device)
    dist.all_reduce(total)
    out, total = {}, total.tolist()
    for i, key in enumerate(keys):
        n = len(splits.train_eval if key == "train" else getattr(splits, key))
        out[f"{key}_loss"] = total[2 * i] / n
        out[f"{key}_acc"] = total[2 * i + 1] / n
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
    """State of one run: model, optimizer, data and its history so far.

    ``model`` is the network the optimizer holds (extended by curvopt for its optimizers);
    ``net`` is what the training forward pass calls: ``model`` itself, or under
    ``torch.distributed`` a ``DistributedDataParallel`` wrapping it.
    """

    def __init__(
        self,
        cfg: RunConfig,
        splits: Splits,
        device: torch.device,
        progress: bool,
        info: DistInfo | None = None,
    ):
        self.info = info = info if info is not None else DistInfo()
        self.cfg, self.splits, self.device = cfg, splits, device
        self.progress = progress and info.main
        self.problem = get_problem(cfg.problem)
        self.prep = self.problem.preprocess(cfg.augment)
        # rank 0 draws as one process would; the others get their own streams (dropout, MC)
        torch.manual_seed(cfg.seed + RANK_SEED_STRIDE * info.rank)
        self.model = self.problem.model(cfg.seed, device)
        self.lossfunc = self.problem.loss()
        self.opt, self.collects = make_optimizer(cfg, self.problem, self.model, self.lossfunc)
        self.net = self.model
        if info.active:  # curvopt extended the inner model above; its module hooks fire inside
            ids = [device.index] if device.type == "cuda" else None
            self.net = torch.nn.parallel.DistributedDataParallel(self.model, device_ids=ids)
        self.data_gen = torch.Generator().manual_seed(cfg.seed)
        self.history: list[dict] = []
        self.resumed_at: list[int] = []
        self.clock = _Clock(device)
        self.label = cfg.name + (" [SYNTHETIC DATA]" if splits.synthetic else "")

    # --- checkpoints -------------------------------------------------------------------------
    def _rng(self) -> dict:
        cuda = torch.cuda.get_rng_state_all() if self.device.type == "cuda" else []
        return {"torch_rng": torch.get_rng_state(), "cuda_rng": cuda}

    def save(self, path: Path) -> None:
        """Rank 0 writes (replicas, optimizer and data order are the same on every rank); the
        ranks' own generators are gathered into ``rank_rng`` (collective)."""
        rng = self._rng()
        ranks = None
        if self.info.active:
            ranks = [None] * self.info.world_size
            dist.all_gather_object(ranks, rng)
        if not self.info.main:
            return
        state = {
            "history": self.history,
            "resumed_at": self.resumed_at,
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            **rng,
            "data_rng": self.data_gen.get_state(),
            "world_size": self.info.world_size,
        }
        if ranks is not None:
            state["rank_rng"] = ranks
        _atomic_write(path, lambda p: torch.save(state, p))

    def load(self, path: Path) -> None:
        state = torch.load(path, map_location=self.device, weights_only=True)
        saved_world = state.get("world_size", 1)
        if saved_world != self.info.world_size:
            raise SetupError(
                f"checkpoint {path} was written by a run on {saved_world} process(es), this one "
                f"has {self.info.world_size}: resume it with the same number of processes "
                f"(torchrun --nproc_per_node={saved_world}, or no torchrun for 1), or delete it "
                "to start the run over"
            )
        rng = state["rank_rng"][self.info.rank] if self.info.active else state
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(rng["torch_rng"].cpu())
        self.data_gen.set_state(state["data_rng"].cpu())
        if rng["cuda_rng"] and self.device.type == "cuda":
            torch.cuda.set_rng_state_all([s.cpu() for s in rng["cuda_rng"]])
        self.history = state["history"]
        self.resumed_at = state["resumed_at"] + [len(self.history) - 1]

    # --- training ----------------------------------------------------------------------------
    def train_epoch(self, epoch: int) -> dict:
        """One pass over the training split; stops early at the first non-finite loss."""
        cfg, clock, info = self.cfg, self.clock, self.info
        times = dict.fromkeys(("forward_s", "backward_s", "step_s"), 0.0)
        loss_sum, correct, seen, diverged = 0.0, 0, 0, False
        n_batches = num_train_batches(self.splits.train, cfg.batch_size)
        batches = train_batches(self.splits.train, cfg.batch_size, self.prep, self.data_gen)
        if info.active:
            # every rank draws the global batches (same generator) and keeps its slice
            times["sync_s"] = 0.0
            batches = _shard(batches, info)
        bar = tqdm(
            batches,
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
            logits = self.net(x)
            loss = self.lossfunc(logits, y)
            t1 = clock()
            if info.active:
                # the global batch's sums, and one decision on all ranks before any backward
                # pass (curvopt refuses a non-finite loss inside backward(), on that rank only)
                sums = torch.stack(
                    [
                        loss.detach().double() * len(y),
                        (logits.argmax(1) == y).sum().double(),
                        torch.tensor(float(len(y)), dtype=torch.float64, device=y.device),
                    ]
                )
                dist.all_reduce(sums)
                batch_loss, batch_correct, batch_seen = sums.tolist()
                t_sync = clock()
                times["sync_s"] += t_sync - t1
                t1 = t_sync
                if not math.isfinite(batch_loss):
                    diverged = True
                    break
            if self.collects:
                with self.opt.collect():
                    loss.backward()
            else:
                loss.backward()
            t2 = clock()
            try:
                self.opt.step()
            except (torch.linalg.LinAlgError, FloatingPointError):
                # a curvature that cannot be inverted or a non-finite step: the setting diverged
                # (raised on every rank alike, so all ranks stop together)
                diverged = True
                break
            t3 = clock()
            times["forward_s"] += t1 - t0
            times["backward_s"] += t2 - t1
            times["step_s"] += t3 - t2
            if info.active:
                loss_sum += batch_loss
                correct += int(batch_correct)
                seen += int(batch_seen)
            else:
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
        metrics = evaluate(
            self.model, self.lossfunc, self.splits, self.cfg.batch_size, self.prep, self.info
        )
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
        keys = ("epoch_s", "forward_s", "backward_s", "step_s")
        total = {k: sum(t.get(k, 0.0) for t in trained) for k in keys}
        if self.info.active:
            total["sync_s"] = sum(t.get("sync_s", 0.0) for t in trained)
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
                "world_size": self.info.world_size,
                **({"distributed": self._dist_record()} if self.info.active else {}),
                "torch": torch.__version__,
                "python": platform.python_version(),
            }
        )

    def _dist_record(self) -> dict:
        return {
            "backend": dist.get_backend(),
            "batch_size_per_rank": self.cfg.batch_size // self.info.world_size,
            "timing": "rank 0's clock; sync_s: the per-step all-reduce of loss and accuracy "
            "(counted apart from forward_s)",
            "evaluation": "each rank evaluates a contiguous slice of every split; sums all-reduced",
        }


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
    _check_distributable(cfg, info)
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
        finished, resume = _from_main((finished, ckpt.exists() if info.main else None))
        if finished is not None:
            return {**finished, "skipped": True}
    dev = resolve_device(device)
    splits = splits if splits is not None else load_splits(cfg, data_root, dev)
    state = _Run(cfg, splits, dev, progress, info)
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
        _atomic_write(out, lambda p: p.write_text(json.dumps(result, indent=1, allow_nan=False)))
        ckpt.unlink(missing_ok=True)
    if status == "diverged" and state.progress:
        tqdm.write(f"{state.label}: diverged in epoch {diverged_epoch}")
    if info.active:
        result = _from_main(result)  # also: no rank returns before the JSON is written
        # DDP sits in a reference cycle; left to the interpreter's exit, after
        # destroy_process_group, it made gloo abort the process in about 1 of 4 runs
        del state
        gc.collect()
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
    digest = hashlib.sha1(
        json.dumps([fixed, list(lrs), list(damping_values), seeds], sort_keys=True).encode()
    ).hexdigest()[:8]
    path = Path(results_dir) / f"grid_{base.problem}_{base.optimizer}_{digest}{tag}.json"
    if info.main:
        _atomic_write(path, lambda p: p.write_text(json.dumps(summary, indent=1)))
    if info.active:
        dist.barrier()
    return {**summary, "path": str(path)}
