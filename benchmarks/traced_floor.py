"""What a pass traced once per structure would cost: the floor of issue 64's option (b).

    OMP_NUM_THREADS=1 python -m benchmarks.traced_floor [--rounds 15] [--repeats 20]

On ``deep_narrow`` (``experiments.overhead``: 33 ``Linear`` modules of width 16, ReLU,
``CrossEntropyLoss``, batch 8, float32, one thread), where a pass costs what Python spends per
module, four ways to get the per-sample gradients ``grad_batch`` (``BatchGrad``) are timed
interleaved (process CPU time, medians over rounds of ``repeats`` passes), as µs per module
beyond the plain pass (``(median - median plain) / 33``):

* ``curvopt``: ``collect(BatchGrad())`` around ``loss.backward()`` on the extended model;
* ``torch.func``: ``vmap(grad(loss of one sample))`` with ``functional_call``;
* ``program``: the work a prepared program must do, written out by hand for this structure:
  the layers applied functionally with each input kept, ``torch.autograd.grad`` of the summed
  loss with respect to every layer output ``z_l``, and per layer ``g_n = N ∂ℓ/∂z_{l,n}``,
  ``∇W_n = g_n a_nᵀ`` (an ``einsum``) and ``∇b_n = g_n``;
* ``traced``: ``program`` recorded once by ``make_fx`` and replayed as one graph of ATen
  operators (curvlinops' route for its traced KFAC);
* ``program plain`` and ``traced plain``: the same without the per-sample gradients (the
  gradients of the mean loss only), the plain pass of a program that replaces the module calls.

``program`` and ``traced`` are checked against ``curvopt`` (max abs deviation printed). The
first line says whether ``make_fx`` can record curvopt's own pass (its first on this
structure), and where it stops: the engine reads values while it runs (its checks), and a
traced graph cannot, so a traced engine would need each such check to become an output of the
graph, tested after the replay.
"""

from __future__ import annotations

import argparse
import statistics
import time
import traceback

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.func import functional_call, grad, vmap

import curvopt
from curvopt import extensions as ext
from experiments.overhead.problems import PROBLEMS

COMMAND = "OMP_NUM_THREADS=1 python -m benchmarks.traced_floor"


def program_of(model: nn.Sequential, lossfunc: nn.Module, per_sample_wanted: bool = True):
    """The per-sample gradients of ``model``'s ``Linear`` layers as a function of their
    parameters ``[W_1, b_1, ...]`` and a batch (the ``program`` of the module doc); with
    ``per_sample_wanted=False`` the same program's plain gradients (``program plain``)."""

    def program(params: list[torch.Tensor], X: torch.Tensor, y: torch.Tensor):
        inputs, outputs, h, i = [], [], X, 0
        for module in model:
            if isinstance(module, nn.Linear):
                inputs.append(h)
                h = F.linear(h, params[i], params[i + 1])
                outputs.append(h)
                i += 2
            else:
                h = module(h)
        loss = lossfunc(h, y)  # a mean: grad_batch holds the terms of p.grad, ∇ℓ_n / N
        if not per_sample_wanted:
            return torch.autograd.grad(loss, params)
        per_sample = []
        for a, g in zip(inputs, torch.autograd.grad(loss, outputs)):
            per_sample += [torch.einsum("no,ni->noi", g, a), g]
        return per_sample

    return program


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    model, X, y, lossfunc = PROBLEMS["deep_narrow"].build()
    modules = sum(isinstance(m, nn.Linear) for m in model.modules())
    curvopt.extend(model)
    lossfunc = curvopt.extend(lossfunc)
    params = list(model.parameters())
    leaves = [p.detach().requires_grad_() for p in params]
    named = {k: v.detach() for k, v in model.named_parameters()}

    def plain():
        for p in params:
            p.grad = None
        lossfunc(model(X), y).backward()

    def engine(X=X, y=y):
        for p in params:
            p.grad = None
        with curvopt.collect(ext.BatchGrad()):
            lossfunc(model(X), y).backward()
        return [p.grad_batch for p in params]

    def one(p, x, t):
        return lossfunc(functional_call(model, p, (x[None],)), t[None])

    try:
        make_fx(engine)(X, y)
        print("make_fx recorded curvopt's pass")
    except Exception as error:  # whatever stops the recording is the finding
        frames = [f for f in traceback.extract_tb(error.__traceback__) if "curvopt" in f.filename]
        where = f" in {frames[-1].name} ({frames[-1].line})" if frames else ""
        reason = f"{type(error).__name__}: {str(error).splitlines()[0][:100]}"
        print(f"make_fx cannot record curvopt's pass{where}: {reason}")

    per_sample_grad = vmap(grad(one), in_dims=(None, 0, 0))
    program = program_of(model, lossfunc)
    traced = make_fx(program)(leaves, X, y)
    program_plain = program_of(model, lossfunc, per_sample_wanted=False)
    traced_plain = make_fx(program_plain)(leaves, X, y)
    reference = engine()
    for label, got in (("program", program(leaves, X, y)), ("traced", traced(leaves, X, y))):
        deviation = max((a - b).abs().max().item() for a, b in zip(got, reference))
        print(f"{label} against curvopt: max abs deviation {deviation:.1e}")

    entries = {
        "plain": plain,
        "curvopt": engine,
        "torch.func": lambda: per_sample_grad(named, X, y),
        "program plain": lambda: program_plain(leaves, X, y),
        "program": lambda: program(leaves, X, y),
        "traced plain": lambda: traced_plain(leaves, X, y),
        "traced": lambda: traced(leaves, X, y),
    }
    times = {name: [] for name in entries}
    for _ in range(args.rounds):
        for name, run in entries.items():
            start = time.process_time()
            for _ in range(args.repeats):
                run()
            times[name].append(1e6 * (time.process_time() - start) / args.repeats)
    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"\n{COMMAND} --rounds {args.rounds} --repeats {args.repeats}")
    print("\n| entry | µs per pass | µs per module beyond plain | vs torch.func |")
    print("|---|---|---|---|")
    beyond = {name: (t - median["plain"]) / modules for name, t in median.items()}
    for name, t in median.items():
        ratio = beyond[name] / beyond["torch.func"] if name != "plain" else float("nan")
        print(f"| {name} | {t:.0f} | {beyond[name]:.1f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
