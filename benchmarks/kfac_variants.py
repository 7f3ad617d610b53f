"""KFAC's cheaper variants on FMNIST 2C2D: steps to 0.88 / 0.90 test accuracy and the cost per
step, beside the default (``expand``, Cholesky inverses every 10 steps).

    OMP_NUM_THREADS=1 python -m benchmarks.kfac_variants [--max-steps 600] [--rounds 3]

Every variant is the time-to-result benchmark's ``practical`` KFAC setting (lr 0.01, damping
0.1, factors every 10 steps with EMA 0.95, momentum 0.9, ``kl_clip`` 1e-3, batch 128, seed 0)
with one change:

* ``reduce``: ``kfac_approx="reduce"`` (the convolutions' factors from position-summed output
  gradients and position-averaged inputs);
* ``eigh``: ``kronecker_damping="trace_norm_eigh"``, ``inverse_interval=100``: the factors'
  eigendecompositions every 100 steps, the trace-norm damping applied in their eigenbases;
* ``eigh_rank256``: as ``eigh`` with ``max_rank=256`` (factors wider than 512: fc1's ``A``
  (3136) and ``B`` (1024), conv2's ``A`` (800) keep their top 256 eigenpairs);
* ``reduce_eigh_rank256``: all three;
* ``sub32``, ``sub16``: ``curvature_samples=32`` (16): the factors from the first 32 (16)
  samples of each batch of 128 (the loader shuffles; docs/optim.md, Approximations);
  ``reduce_eigh_rank256_sub32``: with the three above.

Steps: :func:`experiments.ttr.protocol.train_to_targets` on real Fashion-MNIST (the training
split less the validation hold-out, the first 2,000 test images), evaluated every 25 steps,
stopped at 0.90 or ``--max-steps``. Cost: :func:`experiments.ttr.cost.measure_costs`, all
variants and Adam (lr 4e-3) and EKFAC (``practical``) interleaved in this process, CPU time at
one thread, median of ``--rounds`` blocks of 100 steps (the lcm of the intervals) after one
warm-up round. EKFAC's step is also profiled by phase (``experiments.step_profile``) and its
fc1 rotations timed on their own (:func:`rotation_floor`), for its floor.

Writes ``benchmarks/results/kfac_variants.json`` and ``.md`` (``--out``). One variant alone:

    OMP_NUM_THREADS=1 python -m benchmarks.kfac_variants --variants sub32 --others adam \
        kfac_expand --merge

trains ``--variants`` only, times them beside ``--others`` (cost only: ``adam``, ``ekfac``,
``kfac_expand``; EKFAC's profile and floor only with ``ekfac``), and with ``--merge`` adds the
runs, costs and command to the results files under ``"added"`` instead of replacing them.

``--part ekfac`` does the same for EKFAC's ``practical`` setting (lr 0.01, damping 0.1, basis
every 10 steps, momentum 0.9, ``kl_clip`` 1e-3) and its one-sided variant
``max_basis_dim=1024`` (fc1's 3136-wide input side in the identity basis), with Adam and KFAC
(``expand``) in the cost rounds; it writes ``benchmarks/results/ekfac_variants.*``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from experiments.commands import portable_argument, set_threads
from experiments.config import RunConfig
from experiments.data import load_dataset, make_splits
from experiments.problems import get_problem
from experiments.step_profile import profile
from experiments.ttr.cost import measure_costs
from experiments.ttr.grids import Setting
from experiments.ttr.protocol import TtrProblem, train_to_targets

PROBLEM = "fmnist_2c2d"
TARGETS = (0.88, 0.90)
EIGH = {"kronecker_damping": "trace_norm_eigh", "inverse_interval": 100}
#: variant -> the options it changes in KFAC's ``practical`` setting
VARIANTS: dict[str, dict] = {
    "expand": {},
    "reduce": {"kfac_approx": "reduce"},
    "eigh": EIGH,
    "eigh_rank256": {**EIGH, "max_rank": 256},
    "reduce_eigh_rank256": {**EIGH, "max_rank": 256, "kfac_approx": "reduce"},
    "sub32": {"curvature_samples": 32},
    "sub16": {"curvature_samples": 16},
    "reduce_eigh_rank256_sub32": {
        **EIGH,
        "max_rank": 256,
        "kfac_approx": "reduce",
        "curvature_samples": 32,
    },
}
#: beside the variants in the cost rounds: the reference and EKFAC (for its floor)
OTHERS = {
    "adam": Setting("adam", 4e-3, schedule="warmup_cosine", batch_size=128),
    "ekfac": Setting("ekfac", 0.01, 0.1, "practical", batch_size=128),
}


#: EKFAC's part: variant -> the options it changes in EKFAC's ``practical`` setting
EKFAC_VARIANTS: dict[str, dict] = {"ekfac": {}, "ekfac_one_sided_1024": {"max_basis_dim": 1024}}


def variant(options: dict, optimizer: str = "kfac") -> Setting:
    return Setting(optimizer, 0.01, 0.1, "practical", tuple(options.items()), batch_size=128)


#: what ``--others`` may time beside the variants (cost only)
COST_ONLY = {**OTHERS, "kfac_expand": variant({})}


#: part -> (its optimizer, its variants, what else its cost rounds time, its output)
PARTS = {
    "kfac": ("kfac", VARIANTS, OTHERS, "benchmarks/results/kfac_variants"),
    "ekfac": (
        "ekfac",
        EKFAC_VARIANTS,
        {"adam": OTHERS["adam"], "kfac_expand": COST_ONLY["kfac_expand"]},
        "benchmarks/results/ekfac_variants",
    ),
}


def rotation_floor(rounds: int = 3) -> dict[str, float]:
    """Milliseconds (median, one thread, float32) of EKFAC's dense work on fc1 per step:
    ``Q_Bᵀ G Q_A`` and back (two-sided), ``Q_Bᵀ G`` and back (one-sided, ``A``'s side left in
    the identity basis), and the eigendecompositions of its factors (every basis step)."""
    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(1024, 3136, generator=gen)
    q_b = torch.linalg.qr(torch.randn(1024, 1024, generator=gen))[0]
    q_a = torch.linalg.qr(torch.randn(3136, 3136, generator=gen))[0]
    rows = torch.randn(3200, 3136, generator=gen)
    factor_a = rows.T @ rows / len(rows)
    factor_b = factor_a[:1024, :1024].clone()
    work = {
        "two_sided_rotations_ms": lambda: q_b @ ((q_b.T @ grad @ q_a) @ q_a.T),
        "one_sided_rotations_ms": lambda: q_b @ (q_b.T @ grad),
        "eigh_A_3136_ms": lambda: torch.linalg.eigh(factor_a),
        "eigh_B_1024_ms": lambda: torch.linalg.eigh(factor_b),
    }
    out = {}
    for name, fn in work.items():
        times = []
        for _ in range(rounds):
            start = time.process_time()
            fn()
            times.append(1e3 * (time.process_time() - start))
        out[name] = statistics.median(times)
    return out


def _table(result: dict, others) -> str:
    costs = result["cost"]["entries"]
    adam = costs["adam"]["per_step_s"]
    lines = [
        "| variant | steps to 0.88 / 0.90 | cost per step (ms, CPU) | × Adam "
        "| est. time to 0.90 (s) |",
        "|---|---|---|---|---|",
    ]
    for name, run in result["runs"].items():
        cost = costs[name]["per_step_s"]
        steps = [run["steps_to"][f"{t:g}"] for t in TARGETS]
        shown = " / ".join("—" if s is None else str(s) for s in steps)
        at = "—" if steps[-1] is None or cost is None else f"{steps[-1] * cost:.1f}"
        ratio = "—" if cost is None else f"{cost / adam:.2f}"
        ms = "—" if cost is None else f"{1e3 * cost:.0f}"
        lines.append(f"| {name} | {shown} | {ms} | {ratio} | {at} |")
    for name in others:
        cost = costs[name]["per_step_s"]
        lines.append(f"| {name} (cost only) | | {1e3 * cost:.0f} | {cost / adam:.2f} | |")
    return "\n".join(lines)


def _write(out: Path, optimizer: str, args, result: dict, table: str, command: str, floor: bool):
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    notes = (
        f"EKFAC (`practical`) step by phase, ms: {json.dumps(result['ekfac_profile_ms'])}\n\n"
        f"EKFAC's dense work on fc1, ms: {json.dumps(result['ekfac_fc1_floor_ms'])}\n"
        if floor
        else ""
    )
    out.with_suffix(".md").write_text(
        f"# {optimizer.upper()} variants on {PROBLEM} ({result['date']}, one thread)\n\n"
        f"Command: `{command}` (max steps {args.max_steps}, {args.rounds} cost rounds)\n\n"
        f"{table}\n\n{notes}"
    )


def _merge(out: Path, result: dict, table: str, command: str):
    """Add ``result`` to the results files at ``out`` (JSON: under ``"added"``; Markdown: a
    section with the command and the table of this run, its ratios from its own rounds)."""
    path = out.with_suffix(".json")
    known = json.loads(path.read_text()) if path.exists() else {}
    known.setdefault("added", []).append({"command": command, **result})
    path.write_text(json.dumps(known, indent=1))
    md = out.with_suffix(".md")
    before = md.read_text() if md.exists() else ""
    md.write_text(
        f"{before.rstrip()}\n\n## Added {result['date']}: {', '.join(result['runs'])}\n\n"
        f"Command: `{command}` (its own interleaved cost rounds: compare its ratios, not "
        f"the milliseconds of the table above)\n\n{table}\n"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-steps", type=int, default=600)
    p.add_argument("--rounds", type=int, default=3, help="cost rounds (after one warm-up)")
    p.add_argument("--part", choices=list(PARTS), default="kfac")
    p.add_argument("--variants", nargs="+", help="a subset of the part's variants")
    p.add_argument(
        "--others", nargs="+", choices=list(COST_ONLY), help="cost only (default: the part's)"
    )
    p.add_argument("--merge", action="store_true", help="add to the results files, under 'added'")
    p.add_argument("--out", default=None, help="output path without suffix (default: the part's)")
    p.add_argument("--data-root", default=None)
    args = p.parse_args(argv)
    optimizer, variants, others, out = PARTS[args.part]
    others = {name: COST_ONLY[name] for name in args.others} if args.others else others
    names = args.variants or list(variants)
    print(set_threads(1), flush=True)
    data = load_dataset(get_problem(PROBLEM).dataset, args.data_root)
    splits = make_splits(data, eval_size=2000)
    spec = TtrProblem(targets=TARGETS, max_steps=args.max_steps, eval_every=25, eval_size=2000)
    settings = {name: variant(variants[name], optimizer) for name in names}
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "problem": PROBLEM,
        "spec": asdict(spec),
        "variants": {name: variants[name] for name in names},
        "runs": {},
    }
    for name, setting in settings.items():
        run = train_to_targets(setting, PROBLEM, spec, splits, seed=0)
        result["runs"][name] = asdict(run)
        print(f"{name}: {run.status} after {run.steps} steps, {run.steps_to}", flush=True)
    result["cost"] = measure_costs(
        PROBLEM, {**settings, **others}, splits, rounds=args.rounds, warmup=1
    )
    floor = args.part == "kfac" and "ekfac" in others
    if floor:
        ekfac = RunConfig(PROBLEM, "ekfac", 0.01, damping=0.1, preset="practical")
        result["ekfac_profile_ms"] = profile(ekfac, steps=21)
        result["ekfac_fc1_floor_ms"] = rotation_floor()
    out = Path(args.out or out)
    out.parent.mkdir(parents=True, exist_ok=True)
    table = _table(result, others)
    command = "OMP_NUM_THREADS=1 python -m benchmarks.kfac_variants " + " ".join(
        map(portable_argument, argv if argv is not None else sys.argv[1:])
    )
    if args.merge:
        _merge(out, result, table, command)
    else:
        _write(out, optimizer, args, result, table, command, floor)
    print(table)
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
