"""Where curvopt's fixed per-pass cost goes at batch 8, in µs of real time a pass (not
cProfile's inflated counts), beside the cost of one small torch operator: the floor under the
checks that run on every pass.

    OMP_NUM_THREADS=1 python -m benchmarks.per_pass_parts [--quantity BatchGrad] [--repeats 1000]
    OMP_NUM_THREADS=1 python -m benchmarks.per_pass_parts --model deep_mlp --repeats 300

The pass is ``benchmarks.per_pass_overhead``'s (``--model logreg``: DeepOBS MNIST logistic
regression) or ``benchmarks.per_module_cost``'s (``--model deep_mlp``: 33 ``Linear`` modules,
the launch-bound regime; its parts are also given per module), float32, one thread, its plan
made by warm-up passes. Each part is a function of curvopt wrapped with ``time.perf_counter``
for the run (the wrapper adds about 1 µs a call; the forward hook is wrapped before the model
is extended, as ``extend`` binds it); parts nest (the loss hook holds the walk), so they do not
add up, and a part's time includes its torch operators. The parts named ``guard:`` are the
guards' observers of the pass's events (``guards.observer``): their sum is what the checks
cost beyond what the pass computes. The plain pass (forward, loss, backward of an un-extended
copy) and the pass with the quantity run ``repeats`` times each, one after the other, in the
same process.
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import time

import torch

from benchmarks import per_module_cost, per_pass_overhead
from benchmarks.per_pass_overhead import FIRST_ORDER, SECOND_ORDER

#: ``--model``: its ``setup(batch)`` (``(plain pass, curvopt pass of a quantity)``) and the
#: number of modules its parts are also given per (None: per pass only)
MODELS = {
    "logreg": (per_pass_overhead.setup, None),
    "deep_mlp": (per_module_cost.setup, per_module_cost.MODULES),
}
#: the prefix of the parts that are a guard's observer of an event (``guards.observer``)
GUARD = "guard: "

#: (label, module, attribute path) of the timed parts, in the order a pass reaches them
PARTS = (
    ("forward hooks", "curvopt.frontend.hooks", "_module_forward_hook"),
    ("a new BackwardPass", "curvopt.loop.backward", "BackwardPass.__init__"),
    ("loss hook", "curvopt.loop.routing", "on_loss"),
    ("  the walk of the graph", "curvopt.graph.walk", "Walk.__init__"),
    ("  participation", "curvopt.guards.participation", "Participation.skips_all"),
    ("  row layout (first order)", "curvopt.loop.backward", "BackwardPass._check_layout"),
    ("  earlier values released", "curvopt.engine.accumulate", "Accumulator.release"),
    ("  the loss and modules checked", "curvopt.engine.curvature", "CurvaturePass.check"),
    ("  curvature pass", "curvopt.engine.curvature", "CurvaturePass.run"),
    ("    row layout", "curvopt.engine.curvature", "establish"),
    ("    columns propagated", "curvopt.engine.curvature", "to_calls"),
    ("    the loss's exact columns", "curvopt.losses.base", "LossRule.sqrt_hessian"),
    ("    the loss's sampled columns", "curvopt.losses.base", "LossRule.sqrt_hessian_mc"),
    ("    contributions made and collected", "curvopt.engine.results", "ResultBuffer.add"),
    ("    Kronecker output sides", "curvopt.engine.kron_pass", "kron_factors"),
    ("    Kronecker input sides", "curvopt.engine.kron_pass", "FactorStream.finish"),
    (f"  {GUARD}flow check's hooks placed", "curvopt.guards.flow", "FlowCheck.watch"),
    ("    its region searched", "curvopt.guards.flow", "FlowCheck._region"),
    (f"{GUARD}flow check before a node", "curvopt.guards.flow", "FlowCheck._on_arrival"),
    (f"{GUARD}flow check after a node", "curvopt.guards.flow", "FlowCheck._on_sent"),
    ("module hooks", "curvopt.loop.routing", "_on_module"),
    ("  participation of the module", "curvopt.guards.participation", "Participation.of"),
    (f"  {GUARD}flow check", "curvopt.guards.flow", "FlowCheck.module"),
    ("  parameters' sites", "curvopt.engine.parameter_sites", "SiteReadings.claim"),
    (f"  {GUARD}sum checks at the module", "curvopt.guards.checks", "Checks.module"),
    ("  first-order reducer", "curvopt.engine.reducer", "FirstOrderReducer.add"),
    ("parameter hooks", "curvopt.loop.backward", "BackwardPass.on_parameter_grad"),
    (f"  {GUARD}sum checks at the parameter", "curvopt.guards.checks", "Checks.parameter"),
    ("end of pass", "curvopt.loop.backward", "BackwardPass._finish"),
    (f"  {GUARD}checks at the end", "curvopt.guards.checks", "Checks.finish"),
    (
        "    spot check of per-sample gradients",
        "curvopt.guards.checks",
        "Checks.check_materialised",
    ),
    ("  results written", "curvopt.engine.results", "ResultBuffer.write"),
)


def _timed(totals, label, module, path):
    """Wrap ``module.path`` so that its calls add their time to ``totals[label]``."""
    owner = importlib.import_module(module)
    *outer, name = path.split(".")
    for part in outer:
        owner = getattr(owner, part)
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            totals[label] += time.perf_counter() - start

    setattr(owner, name, wrapper)
    return owner, name, original


def _per_call_us(fn, repeats):
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return 1e6 * (time.perf_counter() - start) / repeats


def operator_floor(repeats: int) -> dict:
    """µs of one small torch operator and of one read of two values to the host."""
    a, b = torch.randn(10), torch.randn(10)
    pair = torch.randn(2)
    for fn in (lambda: torch.add(a, b), pair.tolist):
        fn()
    return {
        "one operator on 10 entries (torch.add)": _per_call_us(lambda: torch.add(a, b), repeats),
        "one read of 2 values (tolist)": _per_call_us(pair.tolist, repeats),
    }


def parts(quantity: str, batch: int, repeats: int, model: str = "logreg") -> tuple:
    """``(pass µs, plain µs, {part: µs a pass})`` of ``quantity`` on ``model`` (``MODELS``)."""
    totals: collections.Counter = collections.Counter()
    wrapped = [_timed(totals, *part) for part in PARTS]
    try:
        plain, with_quantity = MODELS[model][0](batch)
        run = with_quantity(quantity)
        for _ in range(20):
            run()
            plain()
        totals.clear()
        passed = _per_call_us(run, repeats)
        seen = dict(totals)
        plain_us = _per_call_us(plain, repeats)
    finally:
        for owner, name, original in reversed(wrapped):
            setattr(owner, name, original)
    return passed, plain_us, {label: 1e6 * seen.get(label, 0.0) / repeats for label, *_ in PARTS}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=tuple(MODELS), default="logreg")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1000)
    parser.add_argument("--quantity", choices=(*FIRST_ORDER, *SECOND_ORDER), action="append")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    modules = MODELS[args.model][1]
    for label, us in operator_floor(10 * args.repeats).items():
        print(f"{us:7.1f} µs  {label}")
    for quantity in args.quantity or ("BatchGrad", "KFAC"):
        passed, plain_us, timed = parts(quantity, args.batch, args.repeats, args.model)
        guards = sum(us for label, us in timed.items() if label.strip().startswith(GUARD))
        print(f"\n{quantity} on {args.model}: {passed:.0f} µs a pass, plain {plain_us:.0f} µs")
        if modules:
            print(f"(µs a pass, and per module: / {modules})")
            print(f"{(passed - plain_us) / modules:7.1f} µs a module beyond the plain pass")
        for label, us in (*timed.items(), ("the guards' parts, summed", guards)):
            if us:
                per_module = f"  {us / modules:6.1f}" if modules else ""
                print(f"{us:8.1f}{per_module} µs  {label}")


if __name__ == "__main__":
    main()
