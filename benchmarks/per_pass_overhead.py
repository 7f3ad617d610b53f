"""The fixed per-pass cost of curvopt on logreg at batch 8 (µs beyond the plain pass).

    OMP_NUM_THREADS=1 python -m benchmarks.per_pass_overhead [--rounds 15] [--repeats 200]
    OMP_NUM_THREADS=1 python -m benchmarks.per_pass_overhead --profile [--quantity KFAC]
    python -m benchmarks.per_pass_overhead --calls --repeats 50

DeepOBS MNIST logistic regression (784 -> 10, ``experiments.overhead.problems``), batch 8,
float32, one thread: the arithmetic is a few µs (but for the 784 x 784 input factor of KFAC and
KFLR, about 0.5 ms), so what a curvopt pass costs beyond the plain
forward + backward is mostly its fixed Python cost. For each quantity, rounds of ``repeats`` plain
passes (forward, ``CrossEntropyLoss``, backward) and ``repeats`` passes of the same inside
``curvopt.collect(Q())`` are interleaved; each round gives the mean µs of a pass of each kind
(CPU time of the process, ``time.process_time``: on a shared machine the time the process
waits for a core does not count);
the overhead is median(curvopt) - median(plain) over the rounds. The plain pass runs on an
un-extended copy of the model (``extend``'s forward hooks are part of curvopt's cost). A
warm-up pass first (the structure's plan is made and cached, as in training). Prints the
overhead of each quantity; with ``--label`` (e.g. ``before``/``after``) it writes the run into
``benchmarks/results/per_pass_overhead.{md,json}`` under that label (each run keeps the other
labels' rows).

``--profile`` runs cProfile over ``repeats`` passes of one quantity (``--quantity``, all of
them without) and prints the cumulative and own time per pass by curvopt module; ``--calls``
counts the Python and torch operator calls a pass under cProfile (5 warm-up passes first).
"""

from __future__ import annotations

import argparse
import cProfile
import collections
import json
import pathlib
import pstats
import statistics
import time

import torch

import curvopt
from curvopt import extensions as ext
from experiments.overhead.problems import PROBLEMS

FIRST_ORDER = ("BatchGrad", "BatchL2Grad", "SumGradSquared", "Variance")
SECOND_ORDER = ("DiagGGNExact", "DiagGGNMC", "KFAC", "KFLR")
GOALS = {**{q: 50.0 for q in FIRST_ORDER}, **{q: 100.0 for q in SECOND_ORDER}}
RESULTS = pathlib.Path(__file__).parent / "results"
COMMAND = "OMP_NUM_THREADS=1 python -m benchmarks.per_pass_overhead"
#: the sections below this line of ``per_pass_overhead.md`` (paired runs, call counts) are
#: written by hand and kept when the table above is rendered again
KEPT = "<!-- sections below are kept when the table is rendered -->"


def extended(build):
    """``build()``'s ``(model, X, y, lossfunc)`` with the model and the loss extended."""
    model, X, y, lossfunc = build()
    return curvopt.extend(model), X, y, curvopt.extend(lossfunc)


def paired(build):
    """``(plain pass, curvopt pass of a quantity)`` on two models from ``build()`` (``(model,
    X, y, lossfunc)``, the same at each call): the plain pass on an un-extended one (as
    ``experiments.overhead``'s baseline), curvopt's on an extended one."""
    bare, bare_X, bare_y, bare_loss = build()
    model, X, y, lossfunc = extended(build)

    def plain():
        bare.zero_grad(set_to_none=True)
        bare_loss(bare(bare_X), bare_y).backward()

    def with_quantity(name):
        extension = getattr(ext, name)

        def run():
            model.zero_grad(set_to_none=True)
            loss = lossfunc(model(X), y)
            with curvopt.collect(extension()):
                loss.backward()

        return run

    return plain, with_quantity


def setup(batch: int):
    """:func:`paired` on logreg at ``batch``."""
    return paired(PROBLEMS["logreg"].resized(batch).build)


def _mean_us(fn, repeats):
    start = time.process_time()
    for _ in range(repeats):
        fn()
    return 1e6 * (time.process_time() - start) / repeats


def measure(quantities, batch, rounds, repeats, make=None):
    """``{quantity: {plain_us, curvopt_us, overhead_us}}``, rounds interleaved; ``make(batch)``
    gives ``(plain pass, curvopt pass of a quantity)`` (``setup``, logreg, by default)."""
    plain, with_quantity = (make or setup)(batch)
    steps = {q: with_quantity(q) for q in quantities}
    for step in (plain, *steps.values()):  # warm-up: plans cached, buffers allocated
        for _ in range(3):
            step()
    times = {q: [] for q in ("plain", *quantities)}
    for _ in range(rounds):
        times["plain"].append(_mean_us(plain, repeats))
        for q, step in steps.items():
            times[q].append(_mean_us(step, repeats))
            times["plain"].append(_mean_us(plain, repeats))
    base = statistics.median(times["plain"])
    return {
        q: {
            "plain_us": base,
            "curvopt_us": statistics.median(times[q]),
            "overhead_us": statistics.median(times[q]) - base,
        }
        for q in quantities
    }


def profile(quantities, batch, repeats, make=None):
    """Per pass, µs by curvopt module: cumulative (entered from outside it) and own time."""
    for q, stats in _profiled(quantities, batch, repeats, warm=3, make=make):
        own = collections.Counter()
        functions = collections.Counter()
        own_functions = collections.Counter()
        for (path, _line, name), (_, _, tottime, cumtime, _) in stats.items():
            module = _module(path)
            own[module] += tottime
            own_functions[f"{module}:{name}"] += tottime
            if module.startswith("curvopt"):
                functions[f"{module}:{name}"] = cumtime
        total = sum(own.values())
        print(f"\n== {q}: {1e6 * total / repeats:.0f} µs a pass under cProfile")
        print("own time by module (µs a pass)")
        for module, t in own.most_common(25):
            print(f"  {1e6 * t / repeats:8.1f}  {module}")
        print("cumulative time of curvopt functions (µs a pass)")
        for fn, t in functions.most_common(30):
            print(f"  {1e6 * t / repeats:8.1f}  {fn}")
        print("own time of functions (µs a pass)")
        for fn, t in own_functions.most_common(30):
            print(f"  {1e6 * t / repeats:8.1f}  {fn}")


def calls(quantities, batch, repeats, make=None):
    """Per pass, the Python function calls and the torch operator calls (builtins whose name
    names torch or Tensor) under cProfile, whole pass: deterministic, unlike the times."""
    for q, stats in _profiled(quantities, batch, repeats, warm=5, make=make):
        total = sum(v[1] for v in stats.values())
        ops = sum(
            v[1] for k, v in stats.items() if k[0] == "~" and ("torch" in k[2] or "Tensor" in k[2])
        )
        print(f"{q}: {total / repeats:.0f} calls, {ops / repeats:.0f} torch operator calls a pass")


def _profiled(quantities, batch, repeats, warm, make=None):
    """``(quantity, pstats' stats of repeats passes after warm ones)`` for each quantity."""
    _, with_quantity = (make or setup)(batch)
    for q in quantities:
        step = with_quantity(q)
        for _ in range(warm):
            step()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(repeats):
            step()
        profiler.disable()
        yield q, pstats.Stats(profiler).stats


def _module(path: str) -> str:
    parts = pathlib.Path(path).with_suffix("").parts
    if "curvopt" in parts:
        return ".".join(parts[len(parts) - parts[::-1].index("curvopt") - 1 :])
    if "torch" in parts:
        return "torch"
    return "other" if path.startswith("/") else path


def keep_run(path, command, label, batch, rounds, repeats, results) -> None:
    """Record one labelled run in the JSON file ``path`` (the other labels' runs are kept)."""
    RESULTS.mkdir(exist_ok=True)
    runs = json.loads(path.read_text()) if path.exists() else {}
    runs[label] = {
        "command": f"{command} --label {label}",
        "batch": batch,
        "rounds": rounds,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "results": results,
    }
    path.write_text(json.dumps(runs, indent=1) + "\n")


def write(label, batch, rounds, repeats, results):
    keep_run(RESULTS / "per_pass_overhead.json", COMMAND, label, batch, rounds, repeats, results)
    render()


def render():
    """``per_pass_overhead.md`` from the runs kept in ``per_pass_overhead.json``."""
    runs = json.loads((RESULTS / "per_pass_overhead.json").read_text())
    labels = list(runs)
    batch = runs[labels[0]]["batch"]
    lines = [
        f"# Fixed per-pass overhead: logreg (784 -> 10), batch {batch}, float32, one thread",
        "",
        "µs a pass beyond the plain forward + backward: median over rounds of the mean of "
        "`repeats` passes, curvopt and plain interleaved (`benchmarks/per_pass_overhead.py`),",
        "in process CPU time. The machine (2 cores) was shared with three other jobs (load 2-4):",
        "runs minutes apart differ by up to 1.5x, so only the paired columns (the two versions",
        "alternated run by run) compare the versions.",
        "",
    ]
    for lab in labels:
        run = runs[lab]
        lines.append(
            f"* {lab}: `{run['command']}` ({run['rounds']} rounds x {run['repeats']}; "
            f"plain pass {next(iter(run['results'].values()))['plain_us']:.0f} µs)"
        )
    lines += ["", "| quantity | goal | " + " | ".join(labels) + " |"]
    lines.append("|---|---|" + "---|" * len(labels))
    for q in (*FIRST_ORDER, *SECOND_ORDER):
        cells = [
            f"{runs[lab]['results'][q]['overhead_us']:.0f}" if q in runs[lab]["results"] else ""
            for lab in labels
        ]
        lines.append(f"| {q} | ≤ {GOALS[q]:.0f} | " + " | ".join(cells) + " |")
    write_table(RESULTS / "per_pass_overhead.md", lines)


def write_table(path, lines) -> None:
    """Write ``lines`` (a rendered table) to ``path``, keeping what stands below :data:`KEPT`
    there, and print them."""
    old = path.read_text() if path.exists() else ""
    kept = old[old.index(KEPT) :] if KEPT in old else ""
    path.write_text("\n".join(lines) + "\n" + ("\n" + kept if kept else ""))
    print("\n".join(lines))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--quantity", choices=(*FIRST_ORDER, *SECOND_ORDER), action="append")
    parser.add_argument("--label", help="record the run under this label in the results files")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--calls", action="store_true", help="calls a pass (cProfile counts)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    quantities = tuple(args.quantity or (*FIRST_ORDER, *SECOND_ORDER))
    if args.profile:
        profile(quantities, args.batch, args.repeats)
        return
    if args.calls:
        calls(quantities, args.batch, args.repeats)
        return
    results = measure(quantities, args.batch, args.rounds, args.repeats)
    if args.label is None or args.quantity:  # the results file keeps labelled full runs only
        for q, r in results.items():
            print(f"{q}: {r['overhead_us']:.0f} µs (plain {r['plain_us']:.0f} µs)")
        return
    write(args.label, args.batch, args.rounds, args.repeats, results)


if __name__ == "__main__":
    main()
