"""``python -m experiments run ...`` and ``python -m experiments grid ...``: training runs.

Data-parallel on K processes: ``torchrun --nproc_per_node=K -m experiments run ...`` (gloo on
CPU, NCCL on CUDA with one device per process, ``cuda:LOCAL_RANK``); the global batch size stays
the problem's (or ``--batch-size``), each rank trains on ``batch_size / K`` of every batch.
"""

from __future__ import annotations

import argparse
import gc
import sys

import torch.distributed as dist

from .commands import Command, add_threads, set_threads
from .config import RunConfig
from .data import DataMissingError, default_root
from .distributed import dist_info, init_distributed
from .optimizers import DAMPED, OPTIMIZERS, PRESETS, SetupError, parse_options
from .problems import PROBLEMS
from .runner import PAPER_DAMPINGS, PAPER_LRS, grid, run

SYNTHETIC_BANNER = "*** SYNTHETIC DATA: random images and labels, not a real result ***"

_RESULTS = """\
Each run writes RESULTS_DIR/RUN_NAME.json (configuration, metrics after every epoch, wall-clock
times) and a checkpoint after every epoch: started again, a finished run is skipped and an
interrupted one resumes. Missing data stops a run (python -m experiments fetch_data) unless
--synthetic is given. Data-parallel on K processes: torchrun --nproc_per_node=K -m experiments
run ... (each process trains on 1/K of every batch).
"""
RUN_DESCRIPTION = f"""\
Train one optimizer on one DeepOBS problem with one setting, evaluating on the train-eval,
validation and test sets after every epoch. Progress bars show the time left of each epoch, of
each evaluation and of the whole run.

example:
  python -m experiments run fmnist_2c2d kfac --lr 0.1 --damping 0.1 --epochs 3 --train-size 5120

{_RESULTS}"""
GRID_DESCRIPTION = f"""\
The BackPACK paper's protocol for one optimizer on one problem: every (lr, damping) of the grid
with --seed, the best by final validation accuracy, then that setting again with seeds 0 to
SEEDS-1; prints the grid and writes a summary JSON next to the runs.

example:
  python -m experiments grid fmnist_2c2d kfac --seeds 10

{_RESULTS}"""


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "problem", choices=list(PROBLEMS), metavar="PROBLEM", help="one of: " + ", ".join(PROBLEMS)
    )
    p.add_argument(
        "optimizer",
        choices=list(OPTIMIZERS),
        metavar="OPTIMIZER",
        help="one of: " + ", ".join(OPTIMIZERS),
    )
    p.add_argument(
        "--seed", type=int, default=0, help="initialisation, data order and Monte-Carlo draws"
    )
    p.add_argument("--epochs", type=int, help="default: the problem's (50/100/100/350)")
    p.add_argument("--batch-size", type=int, help="default: the problem's (128, 256 for All-CNN-C)")
    p.add_argument(
        "--train-size", type=int, help="train on this many samples only (default: all of them)"
    )
    p.add_argument(
        "--eval-size", type=int, help="cap the train-eval/valid/test sets at this size (default: "
        "no cap)"
    )
    p.add_argument(
        "--valid-size", type=int, default=10_000, help="training samples held out for validation"
    )
    p.add_argument(
        "--no-augment",
        dest="augment",
        action="store_false",
        default=None,
        help="switch off the CIFAR data augmentation",
    )
    p.add_argument(
        "--synthetic",
        action="store_true",
        help="use random data of the right shape (marked synthetic everywhere)",
    )
    p.add_argument(
        "--preset",
        choices=list(PRESETS),
        help="curvature optimizers: paper (every step, constant damping) or practical "
        "(amortised curvature and inverses, EMA, momentum, KL clip); see docs/optim.md",
    )
    p.add_argument(
        "--opt",
        dest="options",
        action="append",
        metavar="KEY=VALUE",
        help="any constructor option of the optimizer (repeatable; overrides the preset), "
        "e.g. --opt momentum=0.9 --opt curvature_interval=10",
    )
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    p.add_argument(
        "--data-root",
        default=None,
        help=f"data folder (default $CURVOPT_DATA or ./data; now {default_root()})",
    )
    p.add_argument(
        "--results-dir", default="results", help="folder of the result JSONs and checkpoints"
    )
    p.add_argument(
        "--no-progress", dest="progress", action="store_false", help="no progress bars"
    )
    add_threads(p, default=None)


def _add_run(p: argparse.ArgumentParser) -> None:
    _common(p)
    p.add_argument("--lr", type=float, required=True, help="learning rate (required)")
    p.add_argument(
        "--damping",
        type=float,
        help=f"damping λ of the curvature optimizers (required for {', '.join(sorted(DAMPED))})",
    )


def _add_grid(p: argparse.ArgumentParser) -> None:
    _common(p)
    p.add_argument(
        "--lrs", type=float, nargs="+", default=list(PAPER_LRS), help="learning rates searched"
    )
    p.add_argument(
        "--dampings",
        type=float,
        nargs="+",
        default=list(PAPER_DAMPINGS),
        help="dampings searched (curvature optimizers only)",
    )
    p.add_argument("--seeds", type=int, default=10, help="seeds of the best setting")


def _config(args, lr: float, damping: float | None) -> RunConfig:
    return RunConfig(
        problem=args.problem,
        optimizer=args.optimizer,
        lr=lr,
        damping=damping,
        seed=args.seed,
        epochs=args.epochs,
        batch_size=args.batch_size,
        train_size=args.train_size,
        eval_size=args.eval_size,
        valid_size=args.valid_size,
        augment=args.augment,
        synthetic=args.synthetic,
        preset=args.preset,
        options=parse_options(args.options),
    )


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.4f}"


def _print_run(result: dict) -> None:
    if result["synthetic"]:
        print(SYNTHETIC_BANNER)
    f, t = result["final"], result["timing"]
    state = "skipped (already finished)" if result.get("skipped") else result["status"]
    print(
        f"{result['name']}: {state}; epoch {f['epoch']}: train loss {_fmt(f['train_loss'])} "
        f"acc {_fmt(f['train_acc'])}, valid acc {_fmt(f['valid_acc'])}, "
        f"test loss {_fmt(f['test_loss'])} acc {_fmt(f['test_acc'])}; "
        f"train {t['epoch_s']:.1f}s (update {t['update_s']:.1f}s), eval {t['eval_s']:.1f}s"
    )


def _print_grid(summary: dict) -> None:
    banner = [SYNTHETIC_BANNER] if summary["synthetic"] else []
    print(
        "\n".join(
            banner
            + [
                f"grid {summary['problem']} / {summary['optimizer']}"
                + (" [SYNTHETIC]" if summary["synthetic"] else "")
            ]
        )
    )
    print(f"{'lr':>8} {'damping':>8} {'status':>9} {'valid acc':>9} {'test acc':>9}")
    best = summary["best"]
    for row in summary["search"]:
        mark = "  <- best" if (row["lr"], row["damping"]) == (best["lr"], best["damping"]) else ""
        damping = "-" if row["damping"] is None else f"{row['damping']:g}"
        print(
            f"{row['lr']:>8g} {damping:>8} {row['status']:>9} {_fmt(row['valid_acc']):>9} "
            f"{_fmt(row['test_acc']):>9}{mark}"
        )
    print(
        f"best over {len(summary['seeds'])} seeds: test acc {_fmt(summary['test_acc_mean'])} "
        f"± {_fmt(summary['test_acc_std'])}  ({summary['path']})"
    )
    if banner:
        print(SYNTHETIC_BANNER)


def _execute(args: argparse.Namespace, command: str) -> int:
    where = {
        "results_dir": args.results_dir,
        "data_root": args.data_root,
        "device": args.device,
        "progress": args.progress,
    }
    started = False
    try:
        started = init_distributed(args.device)  # under torchrun with WORLD_SIZE > 1
        threads = set_threads(args.threads)
        main_rank = dist_info().main
        if args.progress and main_rank:
            print(threads, file=sys.stderr)
        if command == "run":
            result = run(_config(args, args.lr, args.damping), **where)
            if main_rank:
                _print_run(result)
        else:
            damping = args.dampings[0] if args.optimizer in DAMPED else None
            base = _config(args, args.lrs[0], damping)
            summary = grid(base, args.lrs, args.dampings, args.seeds, **where)
            if main_rank:
                _print_grid(summary)
    except (DataMissingError, SetupError, ValueError) as err:
        info = dist_info()
        rank = f"[rank {info.rank}/{info.world_size}] " if info.active else ""
        print(f"{rank}error: {err}", file=sys.stderr)
        return 2
    finally:
        if started:
            gc.collect()  # free what holds the group's work (e.g. DDP) before destroying it
            dist.destroy_process_group()
    return 0


RUN = Command(
    "run",
    "train one optimizer on one problem with one setting",
    RUN_DESCRIPTION,
    _add_run,
    lambda args: _execute(args, "run"),
)
GRID = Command(
    "grid",
    "the paper's grid search of lr x damping, then seeds of the best setting",
    GRID_DESCRIPTION,
    _add_grid,
    lambda args: _execute(args, "grid"),
)
