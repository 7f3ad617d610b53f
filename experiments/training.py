"""The training loop of one run: model, optimizer, epochs, evaluation, checkpoints, result.

Under ``torch.distributed`` with more than one rank, every rank trains a
``DistributedDataParallel`` replica on its slice of each global batch and rank 0 alone writes
checkpoints (see :mod:`experiments.distributed`).
"""

from __future__ import annotations

import math
import platform
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from .config import RunConfig
from .data import Splits, num_train_batches, train_batches
from .distributed import RANK_SEED_STRIDE, DistInfo, shard
from .evaluation import Clock, evaluate
from .files import atomic_write, finite
from .optimizers import SetupError, make_optimizer, resolve_options
from .peers import averaged_weights
from .problems import get_problem
from .timing import finite_loss, timed_step


class TrainingRun:
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
        self.clock = Clock(device)
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
        atomic_write(path, lambda p: torch.save(state, p))

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
            batches = shard(batches, info)
        bar = tqdm(
            batches,
            total=n_batches,
            desc=f"epoch {epoch}/{cfg.epochs}",
            unit="batch",
            leave=False,
            disable=not self.progress,
            dynamic_ncols=True,
        )
        start = clock()
        sums: list[float] = []

        def check(loss, logits, y) -> bool:
            # the global batch's sums, and one decision on all ranks before any backward pass
            # (curvopt refuses a non-finite loss inside backward(), on that rank only)
            local = torch.stack(
                [
                    loss.detach().double() * len(y),
                    (logits.argmax(1) == y).sum().double(),
                    torch.tensor(float(len(y)), dtype=torch.float64, device=y.device),
                ]
            )
            dist.all_reduce(local)
            sums[:] = local.tolist()
            return math.isfinite(sums[0])

        for x, y in bar:
            step = timed_step(
                self.net,
                self.lossfunc,
                self.opt,
                self.collects,
                x,
                y,
                clock,
                check if info.active else finite_loss,
            )
            # a non-finite loss, or a curvature that cannot be inverted or a non-finite step:
            # the setting diverged (decided alike on every rank, so all ranks stop together)
            if step.diverged:
                diverged = True
                break
            check_s = step.times.pop("check_s")
            if info.active:
                times["sync_s"] += check_s
            else:
                step.times["forward_s"] += check_s
            for k, v in step.times.items():
                times[k] += v
            if info.active:
                loss_sum += sums[0]
                correct += int(sums[1])
                seen += int(sums[2])
            else:
                loss_sum += step.loss.item() * len(y)
                correct += (step.logits.argmax(1) == y).sum().item()
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
        with averaged_weights(self.opt):  # schedule-free: its average, not the gradient point
            metrics = evaluate(
                self.model,
                self.lossfunc,
                self.splits,
                self.cfg.batch_size,
                self.prep,
                self.info,
                f"eval {epoch}/{self.cfg.epochs}" if self.progress else None,
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
        """Train the remaining epochs, checkpointing after each; returns status and bad epoch.
        With progress, a bar over the epochs (training and evaluation) estimates the time
        left of the whole run."""
        done = len(self.history) - 1
        with tqdm(
            total=self.cfg.epochs,
            initial=done,
            desc=self.label,
            unit="epoch",
            leave=False,
            disable=not self.progress,
            dynamic_ncols=True,
        ) as run_bar:
            for epoch in range(done + 1, self.cfg.epochs + 1):
                stats = self.train_epoch(epoch)
                if stats["diverged"]:
                    return "diverged", epoch
                entry = self.eval_entry(epoch, stats)
                self.history.append(entry)
                self.log(entry)
                if not math.isfinite(entry["train_loss"]):
                    return "diverged", epoch
                self.save(ckpt)
                run_bar.update()
        return "finished", None

    def log(self, e: dict) -> None:
        if self.progress:
            tqdm.write(
                f"{self.label} epoch {e['epoch']}: train loss {e['train_loss']:.4f} "
                f"acc {e['train_acc']:.4f} | valid acc {e['valid_acc']:.4f} | test acc "
                f"{e['test_acc']:.4f} | {e['time']['epoch_s']:.1f}s "
                f"(+{e['time']['eval_s']:.1f}s eval)"
            )

    def result(self, status: str, diverged_epoch: int | None) -> dict:
        cfg = self.cfg
        trained = [h["time"] for h in self.history[1:]]
        keys = ("epoch_s", "forward_s", "backward_s", "step_s")
        total = {k: sum(t.get(k, 0.0) for t in trained) for k in keys}
        if self.info.active:
            total["sync_s"] = sum(t.get("sync_s", 0.0) for t in trained)
        total["eval_s"] = sum(h["time"]["eval_s"] for h in self.history)
        total["update_s"] = total["backward_s"] + total["step_s"]
        return finite(
            {
                "name": cfg.name,
                "status": status,
                "synthetic": self.splits.synthetic,
                "config": {**asdict(cfg), "options": dict(cfg.options)},
                "optimizer_options": resolve_options(cfg.optimizer, cfg.preset, cfg.options),
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
