"""Cost of a curvature optimizer's step on the models people train, against AdamW's.

    OMP_NUM_THREADS=1 python -m experiments models_cost

Two models in training mode, as users build them: an ``nn.TransformerEncoder`` classifier
(``d=64``, 2 layers, 4 heads, feed-forward 256, dropout 0.1, sequences of 32 tokens) and a
ResNet (a stem and 3 residual blocks of conv, ``BatchNorm2d``, ReLU with 16 channels, on 16x16
images). Each optimizer gets its own copy of the model (seed 0) and steps it with the script
users run, only the optimizer line changed (``F.cross_entropy``, ``loss.backward()``,
``opt.step()``: curvopt's optimizers collect on their own, no ``opt.collect()``).

The timing is that of :mod:`experiments.ttr.cost`: a *block* is ``--block`` consecutive steps of
one optimizer on the same fixed batches (batch size 32); the optimizers' blocks alternate
round-robin, the first rotating from round to round; after ``--warmup`` rounds that are not
counted, an optimizer's cost is the median of its ``--rounds`` block means, by the process's
CPU time (``per_step_s``: with one thread the wall-clock of an idle machine) and by the
wall-clock (``per_step_wall_s``). Writes ``models_cost.json`` and prints the ratios to AdamW.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import curvopt
from fixtures import zoo

from .commands import Command, add_threads, at_least, command_line, relative, set_threads
from .evaluation import Clock
from .timing import PHASES, interleaved, timed_step

BATCH = 32
DEFAULT_DIR = "experiments/results/models_cost"


# ------------------------------------------------------------------------------ the models


class EncoderClassifier(nn.Module):
    """Token and position embeddings, a pre-norm ``nn.TransformerEncoder``, mean pooled, a
    linear head."""

    def __init__(self, vocab=100, length=32, d=64, heads=4, layers=2, classes=10):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(length, d)
        layer = nn.TransformerEncoderLayer(
            d, heads, 4 * d, dropout=0.1, batch_first=True, norm_first=True
        )
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, idx):
        h = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.enc(h).mean(1))


def resnet():
    return zoo.resnet(width=16, blocks=3, classes=10)


def _labels(gen):
    return torch.randint(0, 10, (BATCH,), generator=gen)


def _encoder_batches(gen, count):
    return [(torch.randint(0, 100, (BATCH, 32), generator=gen), _labels(gen)) for _ in range(count)]


def _image_batches(gen, count):
    return [(torch.randn(BATCH, 3, 16, 16, generator=gen), _labels(gen)) for _ in range(count)]


MODELS = {
    "encoder": (EncoderClassifier, _encoder_batches),
    "resnet": (resnet, _image_batches),
}

#: the optimizer line; curvopt's at their defaults (damping 1e-3, kl_clip 1e-3, every step)
OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
    "kfac": lambda params: curvopt.optim.KFAC(params, lr=0.1),
    # the amortised variant: curvature and inverses every 10 steps (a block holds one of each)
    "kfac_every10": lambda params: curvopt.optim.KFAC(
        params, lr=0.1, curvature_interval=10, inverse_interval=10
    ),
    "ekfac": lambda params: curvopt.optim.EKFAC(params, lr=0.1),
    "diag_ggn": lambda params: curvopt.optim.DiagGGNNewton(params, lr=0.1),
}
CURVOPT = ("kfac", "kfac_every10", "ekfac", "diag_ggn")


# ------------------------------------------------------------------------------ measuring


def measure(model_name, optimizers, rounds=7, warmup=1, block=10, log=print) -> dict:
    """``{"block", "rounds", "warmup", "sequence", "parameters", "entries": {optimizer:
    {"per_step_s", "per_step_wall_s", "phases_ms", "rounds_cpu_s", "rounds_wall_s",
    "failed"}}}`` for one model; ``phases_ms``: the median wall-clock milliseconds of each phase
    of :func:`experiments.timing.timed_step` over the counted steps (forward, check, backward
    with the optimizer's collection, step with its inversion)."""
    build, make_batches = MODELS[model_name]
    clock = Clock(torch.device("cpu"))
    batches = make_batches(torch.Generator().manual_seed(0), block)
    entries = {}
    for name in optimizers:
        torch.manual_seed(0)
        model = build()
        if name in CURVOPT:
            model = curvopt.extend(model)
        model.train()
        entries[name] = (model, OPTIMIZERS[name](model.parameters()))
    phases = {n: {k: [] for k in PHASES} for n in optimizers}

    def run_block(name, r):
        model, opt = entries[name]
        for i, (x, y) in enumerate(batches):
            # collects=False: curvopt's optimizers collect on their own, as in users' loops
            step = timed_step(model, F.cross_entropy, opt, False, x, y, clock)
            if step.diverged:
                return f"diverged at step {i} of round {r}"
            if r >= warmup:
                for k in PHASES:
                    phases[name][k].append(step.times[k])
        return None

    measured = interleaved(optimizers, run_block, block, rounds, warmup, clock, model_name, log)
    return {
        "block": block,
        "rounds": rounds,
        "warmup": warmup,
        "sequence": measured.sequence,
        "parameters": sum(p.numel() for p in entries[optimizers[0]][0].parameters()),
        "entries": {
            n: {
                "per_step_s": measured.median(n, 1),
                "per_step_wall_s": measured.median(n, 0),
                "phases_ms": {
                    k[:-2]: 1e3 * statistics.median(phases[n][k]) if phases[n][k] else None
                    for k in PHASES
                },
                "rounds_cpu_s": [t[1] for t in measured.samples[n]],
                "rounds_wall_s": [t[0] for t in measured.samples[n]],
                "failed": measured.failed.get(n),
            }
            for n in optimizers
        },
    }


def ratios(result: dict, baseline: str = "adamw") -> dict:
    """``{optimizer: per_step_s / baseline's}`` (CPU time; ``None`` where one failed)."""
    base = result["entries"].get(baseline, {}).get("per_step_s")
    return {
        n: (e["per_step_s"] / base if base and e["per_step_s"] else None)
        for n, e in result["entries"].items()
    }


# ------------------------------------------------------------------------------ the command

DESCRIPTION = """\
Cost per step of curvopt's optimizers at their defaults against AdamW's, on two models in
training mode as users build them: a TransformerEncoder classifier (d 64, 2 layers, 4 heads,
dropout 0.1, sequences of 32) and a ResNet with BatchNorm (3 blocks of 16 channels, 16x16
images), batch 32. Blocks of --block steps on the same fixed batches alternate round-robin
between the optimizers (the first rotating each round); after --warmup rounds, the cost is the
median of --rounds block means, by CPU time and by wall-clock. kfac_every10 is KFAC with its
curvature and inverses every 10 steps (the amortised cost). Writes models_cost.json into --out
and prints each optimizer's ratio to AdamW. The goal: KFAC at most 3 times AdamW's step.

example: OMP_NUM_THREADS=1 python -m experiments models_cost
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--models", nargs="+", choices=list(MODELS), default=list(MODELS), help="what to time"
    )
    p.add_argument(
        "--optimizers",
        nargs="+",
        choices=list(OPTIMIZERS),
        default=["adamw", "kfac"],
        help="the optimizers, adamw first (the baseline of the ratios)",
    )
    p.add_argument("--rounds", type=at_least(1), default=7, help="counted rounds")
    p.add_argument("--warmup", type=at_least(0), default=1, help="rounds not counted")
    p.add_argument(
        "--block",
        type=at_least(1),
        default=10,
        help="steps per block (a multiple of 10 for kfac_every10, whose curvature and inverses "
        "come every 10 steps)",
    )
    p.add_argument("--out", default=DEFAULT_DIR, metavar="DIR", help="where models_cost.json goes")
    add_threads(p, default=1)


def execute(args: argparse.Namespace) -> int:
    threads = set_threads(args.threads)
    print(threads, flush=True)
    results = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the default diagonal fallback's announcement
        for name in args.models:
            result = measure(name, list(args.optimizers), args.rounds, args.warmup, args.block)
            result["ratio_to_adamw"] = ratios(result)
            results[name] = result
            for n, e in result["entries"].items():
                cost = e["per_step_s"]
                shown = "failed: " + e["failed"] if cost is None else f"{1e3 * cost:.1f} ms/step"
                ratio = result["ratio_to_adamw"][n]
                parts = ", ".join(
                    f"{k} {v:.1f}" for k, v in e["phases_ms"].items() if v is not None
                )
                print(
                    f"{name} {n}: {shown}"
                    + (f", {ratio:.2f}x AdamW" if ratio else "")
                    + (f" (median ms: {parts})" if parts else "")
                )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "command": command_line(sys.argv[1:] if sys.argv[1:2] == ["models_cost"] else []),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "batch_size": BATCH,
        "models": results,
    }
    path = out / "models_cost.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {relative(path)}")
    return 0


MODELS_COST = Command(
    "models_cost",
    "cost per step of curvopt's optimizers against AdamW on a transformer and a ResNet",
    DESCRIPTION,
    add_arguments,
    execute,
    aliases=("models-cost",),
)


def main(argv=None) -> int:
    return MODELS_COST.main(argv)


if __name__ == "__main__":
    sys.exit(main())
