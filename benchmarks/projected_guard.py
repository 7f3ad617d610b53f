"""Per-pass time of the first-order moment quantities with the projected sum check (each rule's
``projected_sum``: ``sum_n g_n`` seen through random probes) against the full one (each rule's
``grad_sum``, the weight gradient recomputed), as a ratio to a plain forward + backward pass.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/projected_guard.py [--rounds 15] [--repeats 5]

A second table times the guard alone per weight (milliseconds, median over rounds), on each
layer's recorded input and a random output gradient: full (``grad_sum``, then
``tolerance.mismatch`` with the gradient) against projected (``projected_sum``, ``uᵀ grad v``
and the comparison with its bound), and which of the two curvopt runs for that weight
(``engine.probes.projection_pays``).

DeepOBS 2C2D (Fashion-MNIST shapes) and 3C3D (CIFAR-10 shapes) at batch 8 and 64, float32, one
thread. "full" runs the same code with every rule's ``projected_sum`` returning ``None``, which
is the previous path exactly (``grad_sum`` per weight, compared in full; ``Variance``'s mean
from that sum). Plain, full and projected passes are interleaved round by round in one
process; each entry is the median over rounds of the mean of ``repeats`` passes; ratio is
projected / full.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from functools import partial

import torch
import torch.nn.functional as F

import curvopt
from curvopt import extensions as ext
from curvopt.engine.probes import draw_probes, projection_pays
from curvopt.guards.projected import PROJECTED_FACTOR, project
from curvopt.guards.tolerance import mismatch
from curvopt.layers.conv import ConvRule
from curvopt.layers.embedding import EmbeddingRule
from curvopt.layers.linear import LinearRule
from curvopt.layers.registry import LayerRule, rule_for
from curvopt.core.calls import Call
from curvopt.layers.transposed_linear import TransposedLinearRule
from experiments.problems import cifar10_3c3d, fmnist_2c2d

NETWORKS = {"2c2d": (fmnist_2c2d, (1, 28, 28)), "3c3d": (cifar10_3c3d, (3, 32, 32))}
EXTENSIONS = (ext.BatchL2Grad, ext.SumGradSquared, ext.Variance)


@contextlib.contextmanager
def full_check():
    """Every rule without ``projected_sum`` (the full ``grad_sum`` check)."""
    classes = (LinearRule, TransposedLinearRule, ConvRule, EmbeddingRule)
    saved = {cls: cls.__dict__["projected_sum"] for cls in classes}
    for cls in saved:
        cls.projected_sum = LayerRule.projected_sum
    try:
        yield
    finally:
        for cls, method in saved.items():
            cls.projected_sum = method


def _pass(model, x, y, extension):
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    if extension is None:
        loss.backward()
        return
    with curvopt.collect(extension()):
        loss.backward()


def _time(fn, repeats):
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def measure(name, batch, rounds, repeats):
    """``{(quantity, 'full' | 'projected'): ratio}`` and the plain pass's milliseconds."""
    make, shape = NETWORKS[name]
    torch.manual_seed(0)
    model = curvopt.extend(make())
    x, y = torch.randn(batch, *shape), torch.randint(0, 10, (batch,))
    cases = [("plain", None, False)]
    for extension in EXTENSIONS:
        cases += [(extension.__name__, extension, True), (extension.__name__, extension, False)]
    times = {(label, full): [] for label, _, full in cases}
    for _ in range(rounds + 1):  # the first round warms up
        for label, extension, full in cases:
            with full_check() if full else contextlib.nullcontext():
                step = partial(_pass, model, x, y, extension)
                times[(label, full)].append(_time(step, repeats))
    median = {key: statistics.median(values[1:]) for key, values in times.items()}
    plain = median[("plain", False)]
    ratios = {
        (label, "full" if full else "projected"): median[(label, full)] / plain
        for label, _, full in cases[1:]
    }
    return ratios, plain * 1e3


def guard_times(name, batch, rounds):
    """``[(layer, full ms, projected ms)]`` for every weight of the network."""
    make, shape = NETWORKS[name]
    torch.manual_seed(0)
    model = make()
    calls = []

    def keep(module, args, out):
        calls.append(Call(module, args, {}, torch.randn_like(out)))

    layers = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]
    handles = [m.register_forward_hook(keep) for m in layers]
    with torch.no_grad():
        model(torch.randn(batch, *shape))
    for handle in handles:
        handle.remove()
    rows = []
    for call in calls:
        grad = rule_for(call.module).grad_sum(call, "weight")
        full, projected = partial(_full_guard, call, grad), partial(_projected_guard, call, grad)
        assert not full() and projected()
        times = {full: [], projected: []}
        for _ in range(rounds):
            for fn in times:
                times[fn].append(_time(fn, 3))
        label = f"{type(call.module).__name__}{tuple(call.module.weight.shape)}"
        chosen = "projected" if projection_pays(call.module.weight) else "full"
        medians = (statistics.median(times[fn]) * 1e3 for fn in (full, projected))
        rows.append((label, *medians, chosen))
    return rows


def _full_guard(call, grad) -> bool:
    """The previous check of one weight: its sum recomputed, compared in full."""
    return mismatch(rule_for(call.module).grad_sum(call, "weight"), grad, 64)


def _projected_guard(call, grad) -> bool:
    """The projected check of one weight: probes, projected sums, ``uᵀ grad v``, the bound."""
    u, v = draw_probes(call.module.weight)
    total, magnitude = rule_for(call.module).projected_sum(call, "weight", u, v)
    gap = (total - project(grad, u, v)).abs_()
    return bool((gap <= magnitude * (PROJECTED_FACTOR * torch.finfo(grad.dtype).eps)).all())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| network | N | plain ms | quantity | full / plain | projected / plain | ratio |")
    print("|---|---|---|---|---|---|---|")
    for name in NETWORKS:
        for batch in (8, 64):
            ratios, plain = measure(name, batch, args.rounds, args.repeats)
            for extension in EXTENSIONS:
                full = ratios[(extension.__name__, "full")]
                projected = ratios[(extension.__name__, "projected")]
                print(
                    f"| {name} | {batch} | {plain:.2f} | {extension.__name__} | {full:.3f} | "
                    f"{projected:.3f} | {projected / full:.3f} |",
                    flush=True,
                )
    print("\n| network | N | weight | full guard ms | projected guard ms | curvopt checks |")
    print("|---|---|---|---|---|---|")
    for name in NETWORKS:
        for batch in (8, 64):
            for label, full, projected, chosen in guard_times(name, batch, args.rounds):
                cells = f"{label} | {full:.3f} | {projected:.3f} | {chosen}"
                print(f"| {name} | {batch} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
