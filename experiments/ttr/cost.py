"""Cost per step, measured interleaved in one process.

Every entry (a problem's winning settings) gets its own model (seed 0) and optimizer. A *block*
is ``L`` consecutive steps of one entry on the same ``L`` fixed training batches (of the entry's
batch size: entries of one batch size share theirs); ``L`` is the
least multiple of the entries' periods (lcm of curvature, inverse and basis intervals) that is
at least ``min_block``, so each block holds the same share of curvature steps as a long run and
its mean is the amortised cost of a step. The entries' blocks alternate round-robin, the
starting entry rotating from round to round; after ``warmup`` rounds that are not counted, an
entry's cost is the median of its ``rounds`` block means.

Two clocks time each block: the process's CPU time (``per_step_s``, the cost: with one thread
it is the wall-clock of an idle machine, and other jobs on a shared machine do not inflate it)
and the wall-clock (``per_step_wall_s``: under load it is inflated, more for long steps than for
steps shorter than the scheduler's time slice, so ratios between entries drift with the load).
An entry that diverges on these batches drops out (costs None, ``failed`` says where).

A compiling peer (:mod:`experiments.peers`) compiles when it is built, before the rounds: its
compilation is not in its cost (``compile`` records it), nor is a recompilation in the first
steps, which fall in the warm-up.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, ContextManager

import torch

from ..data import Splits, train_batches
from ..evaluation import Clock
from ..optimizers import make_optimizer, resolve_options
from ..peers import compile_info
from ..problems import get_problem
from ..timing import interleaved, timed_step
from .grids import Setting

PERIOD_OPTIONS = ("curvature_interval", "inverse_interval", "basis_interval")
#: the fewest steps of a block (a multiple of the periods' lcm)
MIN_BLOCK = 10


def period(setting: Setting) -> int:
    """Steps after which the setting's step pattern repeats (1 for first-order optimizers)."""
    opts = resolve_options(setting.optimizer, setting.preset, setting.options)
    return math.lcm(*(int(opts.get(k, 1)) for k in PERIOD_OPTIONS))


def fixed_batches(splits: Splits, batch_size: int, count: int, prep) -> list:
    """The first ``count`` training batches of seed 0's shuffles (several epochs if needed)."""
    gen = torch.Generator().manual_seed(0)
    batches = []
    while len(batches) < count:
        for xy in train_batches(splits.train, batch_size, prep, gen):
            batches.append(xy)
            if len(batches) == count:
                break
    return batches


def measure_costs(
    problem: str,
    settings: dict[str, Setting],
    splits: Splits,
    rounds: int = 5,
    warmup: int = 1,
    min_block: int = MIN_BLOCK,
    log=print,
    contexts: dict[str, Callable[[], ContextManager]] | None = None,
    built: dict | None = None,
) -> dict:
    """``{"block": L, "sequence": [name per block, in order], "entries": {name: {"setting",
    "batch_size", "compile", "period", "per_step_s" (CPU), "per_step_wall_s", "rounds_cpu_s",
    "rounds_wall_s", "failed"}}}``; the costs are medians over ``rounds`` of the block means.

    ``contexts[name]()`` (optional) is entered around each of that entry's blocks (an A/B of
    one code path: the same setting under two names); ``built`` (optional) receives each
    entry's ``(model, lossfunc, optimizer, collects)``, to be inspected after the rounds."""
    if rounds < 1 or warmup < 0:
        raise ValueError("rounds must be >= 1 and warmup >= 0")
    prob = get_problem(problem)
    device = splits.train.x.device
    clock = Clock(device)
    lcm = math.lcm(*(period(s) for s in settings.values()))
    block = lcm * math.ceil(min_block / lcm)
    entries, sizes = {}, {}
    for name, setting in settings.items():
        cfg = setting.config(problem, 0, splits.synthetic)
        torch.manual_seed(0)
        model, lossfunc = prob.model(0, device), prob.loss()
        opt, collects = make_optimizer(cfg, prob, model, lossfunc)
        entries[name] = (model, lossfunc, opt, collects)
        sizes[name] = cfg.batch_size
    if built is not None:
        built.update(entries)
    prep = prob.preprocess(False)
    fixed = {b: fixed_batches(splits, b, block, prep) for b in set(sizes.values())}
    def run_block(name: str, r: int) -> str | None:
        model, lossfunc, opt, collects = entries[name]
        for i, (x, y) in enumerate(fixed[sizes[name]]):
            if timed_step(model, lossfunc, opt, collects, x, y, clock).diverged:
                return f"diverged at step {i} of round {r} (fixed batches)"
        return None

    def context(name: str) -> ContextManager:
        return (contexts or {}).get(name, contextlib.nullcontext)()

    names = list(settings)
    measured = interleaved(
        names, run_block, block, rounds, warmup, clock, f"{problem} cost", log, context
    )
    return {
        "block": block,
        "rounds": rounds,
        "warmup": warmup,
        "sequence": measured.sequence,
        "entries": {
            n: {
                "setting": settings[n].as_dict(),
                "batch_size": sizes[n],
                "compile": compile_info(entries[n][2]),
                "period": period(settings[n]),
                "per_step_s": measured.median(n, 1),
                "per_step_wall_s": measured.median(n, 0),
                "rounds_wall_s": [t[0] for t in measured.samples[n]],
                "rounds_cpu_s": [t[1] for t in measured.samples[n]],
                "failed": measured.failed.get(n),
            }
            for n in names
        },
    }
