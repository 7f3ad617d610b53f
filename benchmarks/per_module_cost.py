"""curvopt's cost per module in the launch-bound regime: a deep narrow MLP at batch 8.

    OMP_NUM_THREADS=1 python -m benchmarks.per_module_cost [--rounds 15] [--repeats 50]
    OMP_NUM_THREADS=1 python -m benchmarks.per_module_cost --profile --quantity KFAC
    OMP_NUM_THREADS=1 python -m benchmarks.per_module_cost --label before
    OMP_NUM_THREADS=1 python -m benchmarks.per_module_cost --no-gc   # the collector's share
    python -m benchmarks.per_module_cost --calls --repeats 20   # Python calls a pass

32 x (``Linear(16, 16)``, ``ReLU``) and a final ``Linear(16, 10)`` (33 ``Linear`` modules),
``CrossEntropyLoss``, batch 8, float32, one thread. Every operator here is a few µs, so a pass
costs what Python spends per module: the regime of a GPU, where kernels are launched and not
waited for. The timing is ``benchmarks.per_pass_overhead``'s (rounds of ``repeats`` passes,
curvopt and plain interleaved, process CPU time, medians over rounds; the plain pass on an
un-extended copy), and the figure is µs per module:
``(median curvopt pass - median plain pass) / 33``.

The quantities: ``hooks``, the same pass with hooks that do nothing where ``extend`` puts its own
(torch's hook machinery: the floor of any engine built on hooks); ``BatchGrad`` and ``KFAC``
(the ``collect(ext.KFAC())`` pass) and ``step``:
one ``curvopt.optim.KFAC`` step (``zero_grad``, forward, backward inside ``opt.collect()``,
``opt.step()``) against one ``torch.optim.SGD`` step on an un-extended copy; ``step_every_10``
the same with the curvature and inverses every 10 steps (``curvature_interval=10``,
``inverse_interval=10``, the amortised regime of training runs), averaged over its steps.
``--profile`` prints the cProfile breakdown by curvopt module (``per_pass_overhead.profile``),
``--calls`` the Python and torch operator calls of a pass (``per_pass_overhead.calls``);
``--label`` writes the run into ``benchmarks/results/per_module_cost.{md,json}`` (other labels
kept); ``--no-gc`` runs with Python's garbage collector disabled (``gc.disable()``), which shows
what its collections, triggered by the objects a pass keeps alive, cost.
"""

from __future__ import annotations

import argparse
import gc
import json

import torch
from torch import nn

import curvopt
from benchmarks import per_pass_overhead as ppo
from experiments.overhead.problems import PROBLEMS

#: ``experiments.overhead``'s problem of this benchmark (``python -m experiments overhead
#: --problems deep_narrow`` times the peers on it)
PROBLEM = PROBLEMS["deep_narrow"]
MODULES = sum(isinstance(m, nn.Linear) for m in PROBLEM.make_model().modules())
QUANTITIES = ("hooks", "BatchGrad", "KFAC", "step", "step_every_10")
#: the optimizer steps among the quantities: name -> the KFAC's curvature and inverse interval
STEPS = {"step": 1, "step_every_10": 10}
#: µs per module (issue 54); the comparisons the issue quotes, µs per module
GOALS = {"BatchGrad": 60.0, "KFAC": 120.0}
OTHERS = {"BatchGrad": "BackPACK 116, Opacus 84, torch.func 78", "KFAC": "BackPACK 176"}
RESULTS = ppo.RESULTS
COMMAND = "OMP_NUM_THREADS=1 python -m benchmarks.per_module_cost"


def build(batch: int):
    """``(model, X, y, lossfunc)``: the deep narrow MLP and a random batch of ``batch``."""
    return PROBLEM.resized(batch).build()


def setup(batch: int):
    """``(plain pass, curvopt pass of a quantity)`` on the MLP (``per_pass_overhead.paired``)."""
    return ppo.paired(lambda: build(batch))


def with_idle_hooks(batch: int):
    """:func:`build`'s ``(model, X, y, lossfunc)`` with hooks that do nothing where ``extend``
    puts its own: a forward hook with keyword arguments on each ``Linear``, which hooks its
    output's gradient, and a hook on each parameter's gradient."""
    model, X, y, lossfunc = build(batch)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.register_forward_hook(_hook_output, with_kwargs=True)
    for p in model.parameters():
        p.register_hook(_nothing)
    return model, X, y, lossfunc


def hooks_setup(batch: int):
    """``(plain pass, the pass of :func:`with_idle_hooks`' model)`` for ``measure``: what
    torch's hook machinery costs, the floor of any engine built on module hooks."""
    plain, _ = setup(batch)

    def hooked(_name: str):
        model, X, y, lossfunc = with_idle_hooks(batch)

        def run():
            model.zero_grad(set_to_none=True)
            lossfunc(model(X), y).backward()

        return run

    return plain, hooked


def _hook_output(module, args, kwargs, output):
    output.register_hook(_nothing)


def _nothing(grad):
    return None


def sgd_setup(batch: int):
    """``(SGD step on an un-extended copy, curvopt.optim.KFAC step)`` for ``measure``: one
    ``zero_grad``, forward, backward inside ``opt.collect()`` and step each."""
    bare, bare_X, bare_y, bare_loss = build(batch)
    sgd = torch.optim.SGD(bare.parameters(), lr=1e-3)

    def plain():
        sgd.zero_grad(set_to_none=True)
        bare_loss(bare(bare_X), bare_y).backward()
        sgd.step()

    def curvopt_step(name: str):
        model, X, y, lossfunc = ppo.extended(lambda: build(batch))
        every = {"curvature_interval": STEPS[name], "inverse_interval": STEPS[name]}
        opt = curvopt.optim.KFAC(model.parameters(), lr=1e-3, damping=1e-2, **every)

        def step():
            opt.zero_grad(set_to_none=True)
            loss = lossfunc(model(X), y)
            with opt.collect():
                loss.backward()
            opt.step()

        return step

    return plain, curvopt_step


def _setup_of(quantity: str):
    """The ``setup`` that makes ``quantity``'s pass or step beside its plain one."""
    if quantity in STEPS:
        return sgd_setup
    return hooks_setup if quantity == "hooks" else setup


def _by_setup(quantities):
    """``(setup, the quantities it makes)`` for each setup that ``quantities`` need."""
    for make in dict.fromkeys(map(_setup_of, quantities)):
        yield make, [q for q in quantities if _setup_of(q) is make]


def measure(quantities, batch, rounds, repeats):
    """``{quantity: {plain_us, curvopt_us, overhead_us, per_module_us}}``."""
    results = {}
    for make, same in _by_setup(quantities):
        results.update(ppo.measure(same, batch, rounds, repeats, make=make))
    for r in results.values():
        r["per_module_us"] = r["overhead_us"] / MODULES
    return {q: results[q] for q in quantities}


def write(label, batch, rounds, repeats, results):
    path = RESULTS / "per_module_cost.json"
    ppo.keep_run(path, COMMAND, label, batch, rounds, repeats, results)
    render()


def render():
    """``per_module_cost.md`` from the runs kept in ``per_module_cost.json``; the text below
    ``per_pass_overhead.KEPT`` is kept."""
    runs = json.loads((RESULTS / "per_module_cost.json").read_text())
    labels = list(runs)
    lines = [
        f"# Cost per module: {PROBLEM.what}, batch 8, float32, one thread",
        "",
        f"µs per Linear module ({MODULES} of them) beyond the plain pass: (median curvopt pass "
        f"- median plain pass) / {MODULES}, medians over rounds of the mean of `repeats` passes, "
        "curvopt and plain interleaved, in process CPU time (`benchmarks/per_module_cost.py`). "
        "`hooks`: the plain pass with hooks that do nothing where `extend` puts its own. "
        "`step`: a `curvopt.optim.KFAC` step against a `torch.optim.SGD` step; "
        "`step_every_10`: the same with the curvature and inverses every 10 steps. In brackets: "
        "µs of the whole pass (curvopt / plain).",
        "",
    ]
    for lab in labels:
        run = runs[lab]
        lines.append(f"* {lab}: `{run['command']}` ({run['rounds']} rounds x {run['repeats']})")
    lines += ["", "| quantity | goal | others | " + " | ".join(labels) + " |"]
    lines.append("|---|---|---|" + "---|" * len(labels))
    for q in QUANTITIES:
        cells = []
        for lab in labels:
            r = runs[lab]["results"].get(q)
            cells.append(
                f"{r['per_module_us']:.0f} ({r['curvopt_us']:.0f} / {r['plain_us']:.0f})"
                if r
                else ""
            )
        goal = f"≤ {GOALS[q]:.0f}" if q in GOALS else ""
        lines.append(f"| {q} | {goal} | {OTHERS.get(q, '')} | " + " | ".join(cells) + " |")
    ppo.write_table(RESULTS / "per_module_cost.md", lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--quantity", choices=QUANTITIES, action="append")
    parser.add_argument("--label", help="record the run under this label in the results files")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--calls", action="store_true", help="count the calls of a pass")
    parser.add_argument("--no-gc", action="store_true", help="gc.disable() for the run")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.no_gc:
        gc.disable()
    quantities = tuple(args.quantity or QUANTITIES)
    if args.profile or args.calls:
        for make, same in _by_setup(quantities):
            (ppo.calls if args.calls else ppo.profile)(same, args.batch, args.repeats, make=make)
        return
    results = measure(quantities, args.batch, args.rounds, args.repeats)
    for q, r in results.items():
        print(
            f"{q}: {r['per_module_us']:.1f} µs per module ({r['curvopt_us']:.0f} µs a pass, "
            f"plain {r['plain_us']:.0f} µs)"
        )
    if args.label is not None and not (args.quantity or args.no_gc):  # full runs only
        write(args.label, args.batch, args.rounds, args.repeats, results)


if __name__ == "__main__":
    main()
