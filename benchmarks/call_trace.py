"""The calls that pass one loss on through the engine, from the loss hook, by module.

    OMP_NUM_THREADS=1 python -m benchmarks.call_trace [--quantity KFAC] [--first] [--calls]
    OMP_NUM_THREADS=1 python -m benchmarks.call_trace --files [--pass BatchGrad]

Runs a KFAC pass (or ``--quantity``'s) on a plain two-layer MLP, after one warm-up pass (so that
the structure's plan is cached; ``--first`` traces the first pass instead), and traces with
``sys.setprofile`` every call made while ``BackwardPass.on_loss`` runs. A call *passes the loss
on* when curvopt code calls into an engine module of the propagation or engine layer
(the folders ``PASS_FOLDERS``, not the modules ``FOUNDATION`` every step reads) that has no frame
running: a callback into a module still running (a search's ``expand``, a generator expression
passed down) does not leave it, and a hook that torch runs is not a call of curvopt's. Prints the
sequence of modules those calls enter (consecutive repeats merged), how often each module is
entered, and the number of *comebacks*: entries into a module the trace has been in and left
before. A generator resumed is not a new call.

``--files`` lists instead the files of ``curvopt`` that one step of ``optim.KFAC`` on the same
MLP executes (forward, backward in its collection, step; after two warm-up steps), with the
number of their lines run (``sys.settrace``), and how many of them are the optimizer's
(``curvopt/optim/`` and the damping-and-inversion layer it applies, ``curvopt/inversion/``: the
step's reading list on the optimizer side). ``--options`` passes
keyword options to ``KFAC`` (``--options momentum=0.9 weight_decay=1e-3``); ``--pass Q``
lists the files of one ``collect(Q())`` pass instead (``--files --pass BatchGrad``: the
reading list of per-sample gradients).
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import sys

import torch
from torch import nn

import curvopt
from curvopt import extensions as ext
from curvopt.loop.backward import BackwardPass
from curvopt.optim import KFAC

PACKAGE = pathlib.Path(curvopt.__file__).parent
#: the folders of one pass (``curvopt/__init__.py``'s layers 4 to 7); ``autograd`` and ``core``
#: below them are data every layer reads: not a step of the pass
PASS_FOLDERS = {"graph", "engine", "guards", "loop"}
#: the modules of those folders that every step reads: the one graph search, the tolerance
FOUNDATION = {"search", "tolerance", "__init__"}


def _engine_module(code) -> str | None:
    path = pathlib.Path(code.co_filename)
    if path.parent.parent != PACKAGE or path.parent.name not in PASS_FOLDERS:
        return None
    return None if path.stem in FOUNDATION else path.stem


class Tracer:
    """``sys.setprofile`` hook: the engine calls made while ``BackwardPass.on_loss`` runs."""

    def __init__(self):
        self.active = None  # the frame of on_loss while it runs
        self.calls: list = []  # (caller module, callee module, function)
        self.seen: set = set()  # frames entered (a generator's resume is not a call)

    def __call__(self, frame, event, arg):
        if event != "call":
            if event == "return" and frame is self.active:
                self.active = None
            return
        if self.active is None:
            if frame.f_code is BackwardPass.on_loss.__code__:
                self.active = frame
                self.calls.append((None, "backward", "on_loss"))
            return
        if frame in self.seen:
            return
        self.seen.add(frame)
        callee = _engine_module(frame.f_code)
        back = frame.f_back
        if (
            callee is None
            or back is None
            or PACKAGE not in pathlib.Path(back.f_code.co_filename).parents
        ):
            return  # not the engine, or a hook that torch runs
        caller, active = pathlib.Path(back.f_code.co_filename).stem, set()
        while back is not None:
            active.add(pathlib.Path(back.f_code.co_filename).stem)
            back = back.f_back
        if callee not in active:  # a call back into a module still running does not leave it
            self.calls.append((caller, callee, frame.f_code.co_name))


def sequence(calls) -> list:
    """The modules the calls enter, consecutive repeats merged."""
    merged = []
    for _, module, _ in calls:
        if not merged or merged[-1] != module:
            merged.append(module)
    return merged


def comebacks(merged) -> int:
    """Calls into a module the trace entered and left before."""
    seen, count = set(), 0
    for module in merged:
        count += module in seen
        seen.add(module)
    return count


def _mlp():
    torch.manual_seed(0)
    model = curvopt.extend(nn.Sequential(nn.Linear(20, 16), nn.ReLU(), nn.Linear(16, 5)))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    return model, lossfunc, torch.randn(8, 20), torch.randint(0, 5, (8,))


def trace(quantity: str, first: bool) -> Tracer:
    model, lossfunc, x, y = _mlp()
    factory = getattr(ext, quantity)
    for _ in range(0 if first else 1):
        with curvopt.collect(factory()):
            lossfunc(model(x), y).backward()
    tracer = Tracer()
    loss = lossfunc(model(x), y)
    previous = sys.getprofile()
    with curvopt.collect(factory()):
        sys.setprofile(tracer)
        try:
            loss.backward()
        finally:
            sys.setprofile(previous)
    return tracer


def files_of_a_step(**options) -> dict:
    """``{file relative to curvopt: the numbers of its lines run}`` of one step of
    ``optim.KFAC(lr=0.1, damping=1e-2, **options)`` on the MLP (a tracer already set, e.g.
    coverage's, is set back after)."""
    model, lossfunc, x, y = _mlp()
    optimizer = KFAC(model.parameters(), lr=0.1, damping=1e-2, **options)

    def step():
        optimizer.zero_grad()
        with optimizer.collect():
            lossfunc(model(x), y).backward()
        optimizer.step()

    return _lines_run(step)


def files_of_a_pass(quantity: str) -> dict:
    """:func:`files_of_a_step`'s answer for one pass of ``collect(quantity())`` on the MLP
    (forward, loss and backward: the reading list of a quantity)."""
    model, lossfunc, x, y = _mlp()
    factory = getattr(ext, quantity)

    def one_pass():
        model.zero_grad()
        with curvopt.collect(factory()):
            lossfunc(model(x), y).backward()

    return _lines_run(one_pass)


def _lines_run(run) -> dict:
    """The lines of ``curvopt`` that the third of three calls of ``run()`` executes, by file
    (``sys.settrace``; the first two make the structure's plan and the optimizer's state)."""
    lines: dict = collections.defaultdict(set)

    def local(frame, event, arg):
        if event == "line":
            lines[frame.f_code.co_filename].add(frame.f_lineno)
        return local

    def start(frame, event, arg):
        path = pathlib.Path(frame.f_code.co_filename)
        return local if PACKAGE in path.parents else None

    previous = sys.gettrace()
    for call in range(3):
        if call == 2:
            sys.settrace(start)
        try:
            run()
        finally:
            sys.settrace(previous)
    return {pathlib.Path(f).relative_to(PACKAGE).as_posix(): n for f, n in sorted(lines.items())}


#: the folders of a step's optimizer side: the optimizers and the damping-and-inversion layer
OPTIMIZER_SIDE = ("optim/", "inversion/")


def optim_files(found: dict) -> list:
    """The files of the optimizer side (``OPTIMIZER_SIDE``) among those of
    :func:`files_of_a_step`."""
    return [path for path in found if path.startswith(OPTIMIZER_SIDE)]


def _option(text: str):
    name, _, value = text.partition("=")
    return name, None if value == "None" else float(value)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quantity", default="KFAC", help="an extension class name")
    parser.add_argument("--first", action="store_true", help="trace the structure's first pass")
    parser.add_argument("--calls", action="store_true", help="print every call")
    parser.add_argument(
        "--files", action="store_true", help="the files a KFAC step (--pass: a pass) runs"
    )
    parser.add_argument("--pass", dest="quantity_pass", help="with --files: this quantity's pass")
    parser.add_argument("--options", nargs="*", default=[], help="KFAC options, name=value")
    args = parser.parse_args(argv)
    if args.files:
        if args.quantity_pass:
            found = files_of_a_pass(args.quantity_pass)
        else:
            found = files_of_a_step(**dict(map(_option, args.options)))
        for path, numbers in found.items():
            print(f"  {path}: {len(numbers)} lines")
        print(f"files run: {len(found)}, lines run: {sum(map(len, found.values()))}")
        if not args.quantity_pass:
            print(f"of them in curvopt/optim/, curvopt/inversion/: {len(optim_files(found))}")
        return
    tracer = trace(args.quantity, args.first)
    calls = tracer.calls
    if args.calls:
        for caller, callee, name in calls:
            print(f"  {caller} -> {callee}.{name}")
    merged = sequence(calls)
    print("sequence:", " -> ".join(merged))
    counts = collections.Counter(merged)
    print("entries:", ", ".join(f"{m} {n}" for m, n in counts.most_common()))
    print(
        f"calls passing the loss on: {len(calls) - 1}, modules: {len(counts)}, "
        f"comebacks: {comebacks(merged)}"
    )


if __name__ == "__main__":
    main()
