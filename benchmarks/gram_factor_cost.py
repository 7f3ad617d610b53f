"""Curvature averages kept as their Gram roots (``reductions.GramFactor``) against dense
averages, on FMNIST 2C2D: cost per step, the phases of a curvature step and the memory of the
averaged curvature, in one process.

    OMP_NUM_THREADS=1 python -m benchmarks.gram_factor_cost [--rounds 15] [--warmup 10]

Entries: the 2C2D time-to-result winners of ``experiments/results/ttr/cost.json``: schedule-free
AdamW (the reference), schedule-free KFAC and KFAC ``practical``, each KFAC one twice: as the
code is (``root``: an average of rooted factors is its root alone while its Woodbury inverse is
the cheaper one, ``factor_inverse.root_alone``; at most half the factor's rows when the results
were taken) and with every average dense (``dense``: ``transforms.root_alone``
answering no while that entry steps, the code before this change). Cost:
:func:`experiments.ttr.cost.measure_costs` (blocks of 10 steps on fixed training batches, round
robin, CPU time at one thread, median of ``--rounds`` blocks after ``--warmup`` rounds); then the
bytes of every parameter's ``state["curvature"]`` of each entry (after ``warmup + rounds`` blocks);
then :func:`experiments.step_profile.profile` of schedule-free KFAC (``--profile-steps`` steps on
one random batch) in both forms, and of schedule-free AdamW: median forward / backward / step of
the curvature steps and of the others; then the setup of fc1's damped input factor (3136 wide)
from a Gram root of ``r`` rows, :meth:`LowRankInverse.of` (Woodbury: ``U Uᵀ``, its ``r × r``
eigendecomposition, the basis), against the dense ``cholesky_inverse``, median of 3.
Writes ``benchmarks/results/gram_factor.json`` and ``.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import curvopt.optim.transforms
from curvopt.core.reductions import GramFactor, gram
from curvopt.inversion.factor_inverse import LowRankInverse, add_diagonal, cholesky_inverse
from experiments.commands import set_threads
from experiments.data import load_dataset, make_splits
from experiments.problems import get_problem
from experiments.step_profile import profile
from experiments.ttr.cost import measure_costs
from experiments.ttr.grids import Setting

PROBLEM = "fmnist_2c2d"
COSTS = Path("experiments/results/ttr/cost.json")
#: the winners measured, the reference first
ENTRIES = ("sf_adamw", "sf_kfac", "kfac")
#: the winners whose averages take either form
KRONECKER = ("sf_kfac", "kfac")


@contextlib.contextmanager
def dense_averages():
    """Every curvature average dense, as before ``GramFactor`` (the EMA never keeps a root
    alone)."""
    transforms = curvopt.optim.transforms
    original = transforms.root_alone
    transforms.root_alone = lambda rows, dim: False
    try:
        yield
    finally:
        transforms.root_alone = original


def curvature_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the averaged curvature in ``opt``'s state (a ``GramFactor``: its root)."""
    total = 0
    for state in opt.state.values():
        for factor in state.get("curvature") or []:
            tensor = factor.root if isinstance(factor, GramFactor) else factor
            total += tensor.numel() * tensor.element_size()
    return total


#: fc1's input width, and the root rows timed (its average gains 16 or 128 rows a curvature step)
WIDTH, ROWS = 3136, (128, 512, 1024, 1568)


def woodbury_setup_ms(width: int = WIDTH, rows=ROWS, shift: float = 0.03) -> dict:
    """``{r: {"woodbury_ms", "dense_ms"}}``: ``LowRankInverse.of`` from ``r`` rows of ReLU
    features against ``cholesky_inverse`` of the damped dense factor, medians of 3."""

    def median_ms(fn) -> float:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - start))
        return statistics.median(times)

    features = torch.randn(max(rows), width, generator=torch.Generator().manual_seed(0)).relu()
    out = {}
    for r in rows:
        root = features[:r] / r**0.5
        dense = gram(root)
        out[r] = {
            "woodbury_ms": median_ms(lambda root=root: LowRankInverse.of(root, shift)),
            "dense_ms": median_ms(lambda dense=dense: cholesky_inverse(add_diagonal(dense, shift))),
        }
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--profile-steps", type=int, default=101)
    parser.add_argument("--out", default="benchmarks/results/gram_factor")
    args = parser.parse_args(argv)
    set_threads(1)
    winners = json.loads(COSTS.read_text())["problems"][PROBLEM]["entries"]
    settings = {name: Setting.from_dict(winners[name]["setting"]) for name in ENTRIES}
    for name in KRONECKER:
        settings[f"{name}_dense"] = settings[name]
    contexts = {f"{name}_dense": dense_averages for name in KRONECKER}
    splits = make_splits(load_dataset(get_problem(PROBLEM).dataset), eval_size=1)
    built: dict = {}
    costs = measure_costs(
        PROBLEM, settings, splits, args.rounds, args.warmup, contexts=contexts, built=built
    )
    reference = costs["entries"]["sf_adamw"]["per_step_s"]
    rows = {}
    for name, entry in costs["entries"].items():
        rows[name] = {
            "setting": settings[name].label,
            "ms_per_step": 1e3 * entry["per_step_s"],
            "x_sf_adamw": entry["per_step_s"] / reference,
            "curvature_mb": curvature_bytes(built[name][2]) / 2**20,
            "rounds_ms": [1e3 * t for t in entry["rounds_cpu_s"]],
        }
    config = settings["sf_kfac"].config(PROBLEM, 0)
    profiles = {"root": profile(config, args.profile_steps)}
    with dense_averages():
        profiles["dense"] = profile(config, args.profile_steps)
    profiles["sf_adamw"] = profile(settings["sf_adamw"].config(PROBLEM, 0), args.profile_steps)
    result = {
        "meta": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "command": "python -m benchmarks.gram_factor_cost " + " ".join(sys.argv[1:]),
            "rounds": args.rounds,
            "warmup": args.warmup,
            "block": costs["block"],
        },
        "costs": rows,
        "sf_kfac_profile": profiles,
        "woodbury_setup": woodbury_setup_ms(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(report(result))
    print(report(result))


def report(result: dict) -> str:
    meta = result["meta"]
    lines = [
        "# Curvature averages as Gram roots (`GramFactor`) against dense averages, FMNIST 2C2D",
        "",
        f"`OMP_NUM_THREADS=1 {meta['command']}` ({meta['date']}, torch {meta['torch']}): blocks "
        f"of {meta['block']} steps on fixed training batches, interleaved, CPU time at one "
        f"thread, median of {meta['rounds']} blocks after {meta['warmup']} warm-up rounds; the "
        "averaged curvature's memory after all of them.",
        "",
        "| entry | setting | ms/step | × sf_adamw | averaged curvature (MB) |",
        "|---|---|---|---|---|",
    ]
    for name, row in result["costs"].items():
        lines.append(
            f"| {name} | {row['setting']} | {row['ms_per_step']:.1f} | "
            f"{row['x_sf_adamw']:.3f} | {row['curvature_mb']:.1f} |"
        )
    lines += [
        "",
        "Schedule-free KFAC's phases with either form of the averages, and schedule-free "
        "AdamW's (`experiments.step_profile.profile`, one random batch, medians, ms):",
        "",
        "| averages | steps | forward | backward | step |",
        "|---|---|---|---|---|",
    ]
    for form, phases in result["sf_kfac_profile"].items():
        for kind, p in phases.items():
            lines.append(
                f"| {form} | {kind} ({p['n']}) | {p['forward_ms']:.1f} | "
                f"{p['backward_ms']:.1f} | {p['step_ms']:.1f} |"
            )
    lines += [
        "",
        f"The setup of a damped {WIDTH}-wide factor from a Gram root of r rows (median of 3, ms):",
        "",
        "| r | Woodbury (`LowRankInverse.of`) | dense (`cholesky_inverse`) |",
        "|---|---|---|",
    ]
    for r, t in result["woodbury_setup"].items():
        lines.append(f"| {r} | {t['woodbury_ms']:.0f} | {t['dense_ms']:.0f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
