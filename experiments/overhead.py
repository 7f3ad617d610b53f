"""Overhead of curvopt's quantities, as ratios to a plain forward+backward pass.

    python -m experiments.overhead                       # default: all problems, all backends found
    python -m experiments.overhead --problems 3c3d --json overhead.json
    python -m experiments.overhead --profile 3c3d:Variance   # torch.profiler table of one case

Every *case* is a (problem, quantity) pair, run by every *backend* that can compute it:

* problems   ``benchmarks.models.PROBLEMS`` (3C3D, MLP, small CNN, transformer block)
* quantities ``QUANTITIES``: "hooks only" (extended model, no ``collect``) and first-order
             extensions; more with :func:`register_quantity`, e.g. second order::

                 register_quantity(Quantity("DiagGGNExact", "DiagGGNExact",
                                            (ext.DiagGGNExact,), order=2))
                 DEFAULT_CASES.append(("3c3d", "DiagGGNExact"))
                 TARGETS[("3c3d", "DiagGGNExact")] = 2.0   # optional

             curvopt and BackPACK run any quantity; torch.func and Opacus only order 1
* backends   ``BACKENDS``: ``curvopt`` always; ``torch.func`` (``vmap(grad)``), ``opacus``
             (``GradSampleModule``) and ``backpack`` when importable. A backend that cannot
             compute a case answers with :class:`Unsupported` and the cell reads ``n/a``.

Each backend works on its own copy of the network (same weights, same batch). A step is one
training iteration's gradient work: ``zero_grad(set_to_none=True)``, forward, loss, backward, plus
what the backend needs to turn its output into the quantity (e.g. torch.func's reductions of the
per-sample gradients). No step keeps a reference to a result, so curvopt reuses its
``grad_batch`` buffers as in a training loop.

Timing is interleaved: after a warm-up (buffers allocated, steady state), each round runs every
step of a problem in a freshly shuffled order and divides each step's time by the plain step's
time *of the same round*; a step's time in a round is the fastest of a few consecutive calls
(about ``--min-sample-ms`` worth), which discards calls hit by preemption. The table shows the
median of the per-round ratios (``--spread`` adds quartiles; JSON has them, the raw times, and
how busy other processes kept the CPUs in each round; ``--max-other-load`` drops busy rounds).
``torch.set_num_threads`` is fixed (``--threads``, default 2) and printed. Run as a script, this
module sets ``OMP_WAIT_POLICY=PASSIVE`` unless the variable is set: with spinning OpenMP workers
a busy machine makes 2-thread steps erratically 5-100x slower.

Competitors are optional. Opacus and BackPACK need no install into the project's environment:
``pip install --no-deps --target DIR opacus backpack-for-pytorch`` and ``PYTHONPATH=DIR``
(their imports need neither torchvision nor their other dependencies; delete the top-level
``benchmarks``/``examples`` folders the Opacus wheel puts into DIR).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

if __name__ == "__main__":
    # Spinning OpenMP workers turn every parallel region into a wait for a preempted thread
    # on a busy machine (2-thread steps 5-100x slower, erratically); sleeping workers keep
    # the timings stable. Must be set before torch loads OpenMP; export it to override.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from torch import nn

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # ``benchmarks`` is a folder next to ``experiments``
    sys.path.insert(0, str(_ROOT))

import curvopt  # noqa: E402
from curvopt import extensions as ext  # noqa: E402


def _load_models():
    """``benchmarks/models.py`` of this repository, loaded by path.

    ``benchmarks/`` has no ``__init__.py``, so ``import benchmarks.models`` would pick up any
    installed top-level ``benchmarks`` package first (the Opacus wheel ships one).
    """
    import importlib.util

    path = _ROOT / "benchmarks" / "models.py"
    for name in ("benchmarks.models", "_curvopt_benchmark_models"):
        mod = sys.modules.get(name)
        if mod is not None and Path(getattr(mod, "__file__", "")).resolve() == path:
            return mod
    spec = importlib.util.spec_from_file_location("_curvopt_benchmark_models", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


models = _load_models()
PROBLEMS: dict[str, models.Problem] = models.PROBLEMS
Problem = models.Problem

Step = Callable[[], None]

PLAIN = "plain"  # name of the baseline quantity: un-extended model, forward + backward


class Unsupported(Exception):
    """A backend cannot compute this case (the cell reads ``n/a``)."""


# ------------------------------------------------------------------------------------ quantities
@dataclass(frozen=True)
class Quantity:
    """What a step computes. ``extensions`` are curvopt extension factories (empty: no collect)."""

    name: str
    label: str
    extensions: tuple[Callable[[], ext.Extension], ...] = ()
    order: int = 1
    extended: bool = True  # whether the model is ``curvopt.extend``-ed at all (False: baseline)

    def attrs(self) -> tuple[str, ...]:
        return tuple(factory().attr for factory in self.extensions)


QUANTITIES: dict[str, Quantity] = {}


def register_quantity(quantity: Quantity) -> Quantity:
    QUANTITIES[quantity.name] = quantity
    return quantity


register_quantity(Quantity(PLAIN, "plain forward+backward", extended=False))
register_quantity(Quantity("hooks", "extended, no collect (hooks only)"))
FIRST_ORDER = (ext.BatchGrad, ext.BatchL2Grad, ext.SumGradSquared, ext.Variance)
for _cls in FIRST_ORDER:
    register_quantity(Quantity(_cls.__name__, _cls.__name__, (_cls,)))
register_quantity(Quantity("first_order", "all four first-order", FIRST_ORDER))
SECOND_ORDER = (
    ext.DiagGGNMC, ext.KFAC, ext.KFLR, ext.DiagGGNExact, ext.DiagHessian, ext.KFRA,
)
for _cls in SECOND_ORDER:
    register_quantity(Quantity(_cls.__name__, _cls.__name__, (_cls,), order=2))

#: cases measured by default: (problem, quantity); the plain step is always measured too
DEFAULT_CASES: list[tuple[str, str]] = [
    (problem, quantity)
    for problem in ("3c3d", "mlp", "cnn", "transformer")
    for quantity in (
        "hooks",
        "BatchGrad",
        "BatchL2Grad",
        "SumGradSquared",
        "Variance",
        "first_order",
    )
] + [
    ("3c3d", "DiagGGNMC"),
    ("3c3d", "KFAC"),
    ("3c3d", "KFLR"),
    ("3c3d", "DiagGGNExact"),
    ("mlp", "KFRA"),
]
#: slow cases, measured only when asked for (``--problems 3c3d_sigmoid allcnnc``)
EXTRA_CASES: list[tuple[str, str]] = [
    ("3c3d_sigmoid", "DiagHessian"),
    ("allcnnc", "DiagGGNExact"),
]

#: the issue's targets for curvopt (ratio to plain forward+backward)
TARGETS: dict[tuple[str, str], float] = {
    ("3c3d", "hooks"): 1.03,
    ("3c3d", "BatchL2Grad"): 1.2,
    ("3c3d", "SumGradSquared"): 1.4,
    ("3c3d", "Variance"): 1.4,
    ("cnn", "BatchGrad"): 1.1,
    ("mlp", "BatchGrad"): 4.0,
    ("3c3d", "DiagGGNMC"): 1.8,
    ("3c3d", "KFAC"): 1.8,
    ("3c3d", "KFLR"): 3.4,
    ("3c3d", "DiagGGNExact"): 5.9,
    ("3c3d_sigmoid", "DiagHessian"): 180.0,
    ("mlp", "KFRA"): 5.0,
}


# ------------------------------------------------------------------------------------ backends
@dataclass
class Instance:
    """One backend's private copy of a problem."""

    model: nn.Module
    X: torch.Tensor
    y: torch.Tensor
    lossfunc: nn.Module

    @property
    def batch_size(self) -> int:
        return self.X.shape[0]

    @classmethod
    def of(cls, problem: Problem, device: str = "cpu") -> Instance:
        """A fresh copy of ``problem`` (same weights and batch every call) on ``device``."""
        model, X, y, lossfunc = problem.build()
        return cls(model.to(device), X.to(device), y.to(device), lossfunc.to(device))


def reductions(gb: torch.Tensor, attrs: Sequence[str], n: int) -> dict[str, torch.Tensor]:
    """First-order quantities from per-sample gradients ``gb [N, *p]`` (API.md conventions)."""
    out: dict[str, torch.Tensor] = {}
    if "grad_batch" in attrs:
        out["grad_batch"] = gb
    if any(a in attrs for a in ("batch_l2", "sum_grad_squared", "variance")):
        sq = gb * gb
        if "batch_l2" in attrs:
            out["batch_l2"] = sq.reshape(n, -1).sum(1)
        if "sum_grad_squared" in attrs or "variance" in attrs:
            sgs = sq.sum(0)
            out["sum_grad_squared"] = sgs
            if "variance" in attrs:
                out["variance"] = sgs / n - (gb.sum(0) / n) ** 2
    return out


class Backend:
    """Turns a problem and a quantity into a step; ``available()`` says why not, if not."""

    name = ""

    def available(self) -> str | None:
        return None

    def make_step(self, inst: Instance, quantity: Quantity) -> Step:
        raise NotImplementedError

    def verify(self, inst: Instance, quantity: Quantity) -> None:
        """After one step: raise :class:`Unsupported` if the quantity was not fully computed."""


def _verify_attributes(backend: str, inst: Instance, quantity: Quantity) -> None:
    """Every parameter that requires grad carries every attribute of ``quantity``."""
    for name, p in inst.model.named_parameters():
        if not p.requires_grad:
            continue
        missing = [a for a in quantity.attrs() if getattr(p, a, None) is None]
        if missing:
            raise Unsupported(f"{backend} wrote no {', '.join(missing)} for {name}")


class PlainBackend(Backend):
    """The baseline: the un-extended model, ``zero_grad``, forward, loss, backward."""

    name = "plain"

    def make_step(self, inst, quantity):
        if quantity.name != PLAIN:
            raise Unsupported("the plain backend only runs the baseline")
        model, X, y, lossfunc = inst.model, inst.X, inst.y, inst.lossfunc

        def step():
            model.zero_grad(set_to_none=True)
            lossfunc(model(X), y).backward()

        return step


class CurvoptBackend(Backend):
    name = "curvopt"

    def verify(self, inst, quantity):
        _verify_attributes(self.name, inst, quantity)

    def make_step(self, inst, quantity):
        if not quantity.extended:
            raise Unsupported("baseline")
        model = curvopt.extend(inst.model)
        lossfunc = curvopt.extend(inst.lossfunc)
        X, y = inst.X, inst.y
        if not quantity.extensions:

            def step():
                model.zero_grad(set_to_none=True)
                lossfunc(model(X), y).backward()

            return step
        extensions = [factory() for factory in quantity.extensions]

        def step():
            model.zero_grad(set_to_none=True)
            loss = lossfunc(model(X), y)
            with curvopt.collect(*extensions):
                loss.backward()

        return step


class TorchFuncBackend(Backend):
    """``vmap(grad(loss of one sample))`` via ``functional_call``; reductions computed from it.

    The per-sample loss is divided by N (the ``reduction="mean"`` convention) and ``p.grad`` is
    set to the sum of the per-sample gradients, so the step yields what curvopt's does.
    """

    name = "torch.func"

    def make_step(self, inst, quantity):
        from torch.func import functional_call, grad, vmap

        if not quantity.extensions or quantity.order != 1:
            raise Unsupported("torch.func computes per-sample gradients only")
        model, X, y, lossfunc = inst.model, inst.X, inst.y, inst.lossfunc
        n = inst.batch_size
        names = [k for k, p in model.named_parameters() if p.requires_grad]
        params = dict(model.named_parameters())
        buffers = dict(model.named_buffers())
        attrs = quantity.attrs()

        def loss_one(p, x, t):
            out = functional_call(model, (p, buffers), (x.unsqueeze(0),))
            return lossfunc(out, t.unsqueeze(0)) / n

        per_sample = vmap(grad(loss_one), in_dims=(None, 0, 0))

        def step():
            model.zero_grad(set_to_none=True)
            detached = {k: params[k].detach() for k in names}
            grads = per_sample(detached, X, y)
            for k in names:
                gb = grads[k]
                params[k].grad = gb.sum(0)
                reductions(gb, attrs, n)
            del grads

        return step


class OpacusBackend(Backend):
    """``opacus.GradSampleModule`` (hooks, functorch for layers it has no rule for).

    ``p.grad_sample`` is the gradient of each sample's own loss (Opacus rescales the mean), so
    it is multiplied by ``1/N`` before the reductions.
    """

    name = "opacus"

    def available(self):
        try:
            import opacus  # noqa: F401
        except Exception as e:  # noqa: BLE001
            return f"not importable ({type(e).__name__}: {e})"
        return None

    def make_step(self, inst, quantity):
        from opacus import GradSampleModule

        if not quantity.extensions or quantity.order != 1:
            raise Unsupported("Opacus computes per-sample gradients only")
        try:
            model = GradSampleModule(inst.model, loss_reduction="mean")
        except Exception as e:
            raise Unsupported(f"GradSampleModule: {type(e).__name__}: {e}") from e
        X, y, lossfunc = inst.X, inst.y, inst.lossfunc
        n = inst.batch_size
        params = [p for p in model.parameters() if p.requires_grad]
        attrs = quantity.attrs()

        def step():
            model.zero_grad(set_to_none=True)
            lossfunc(model(X), y).backward()
            for p in params:
                gb = p.grad_sample
                if gb is None:
                    raise Unsupported("no grad_sample for a parameter")
                reductions(gb.mul_(1.0 / n), attrs, n)

        return step


class BackpackBackend(Backend):
    """BackPACK: ``extend`` model and loss, ``with backpack(...)`` around ``backward``.

    BackPACK's extensions have curvopt's class names, options and attribute names (API.md
    follows BackPACK), so any quantity maps by name, second-order ones included.
    """

    name = "backpack"

    def verify(self, inst, quantity):
        # BackPACK only warns about modules it has no rule for (here: attention, LayerNorm)
        _verify_attributes(self.name, inst, quantity)

    def available(self):
        try:
            import backpack  # noqa: F401
        except Exception as e:  # noqa: BLE001
            return f"not importable ({type(e).__name__}: {e})"
        return None

    def make_step(self, inst, quantity):
        import backpack
        from backpack import extensions as bext

        if quantity.extended and quantity.extensions:
            exts = []
            for factory in quantity.extensions:
                mine = factory()
                theirs = getattr(bext, type(mine).__name__, None)
                if theirs is None:
                    raise Unsupported(f"BackPACK has no {type(mine).__name__}")
                exts.append(theirs(**mine.options))
        elif quantity.extended:
            exts = []
        else:
            raise Unsupported("baseline")
        model = backpack.extend(inst.model)
        lossfunc = backpack.extend(inst.lossfunc)
        X, y = inst.X, inst.y

        def step():
            model.zero_grad(set_to_none=True)
            loss = lossfunc(model(X), y)
            if exts:
                with backpack.backpack(*exts):
                    loss.backward()
            else:
                loss.backward()

        return step


BACKENDS: dict[str, Backend] = {
    b.name: b for b in (CurvoptBackend(), TorchFuncBackend(), OpacusBackend(), BackpackBackend())
}


# ------------------------------------------------------------------------------------ timing
@dataclass
class Result:
    problem: str
    quantity: str
    backend: str
    times: list[float] = field(default_factory=list)  # seconds per step, one per round
    ratios: list[float] = field(default_factory=list)  # times[r] / plain times[r]
    error: str | None = None

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios) if self.ratios else math.nan

    def quartiles(self) -> tuple[float, float]:
        if len(self.ratios) < 2:
            return (self.ratio, self.ratio)
        q = statistics.quantiles(self.ratios, n=4)
        return q[0], q[2]


def _sync(device: str) -> Callable[[], None]:
    if torch.device(device).type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def _time(step: Step, reps: int, sync: Callable[[], None] = lambda: None) -> float:
    """Seconds of the fastest of ``reps`` consecutive calls of ``step`` (robust to preemption)."""
    best = math.inf
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        step()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


class OtherLoad:
    """Share of all CPUs that *other* processes kept busy since the last call (Linux only).

    From ``/proc/stat`` (all CPUs' busy time) minus this process's CPU time; ``None`` where
    ``/proc/stat`` is missing. 0 on an idle machine, 1 when others saturate every core.
    """

    def __init__(self):
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._cpus = os.cpu_count() or 1
        self._last = self._read()

    def _read(self):
        try:
            with open("/proc/stat") as f:
                fields = [int(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        busy = (sum(fields[:8]) - idle) / self._tick
        return busy, time.process_time(), time.perf_counter()

    def __call__(self) -> float | None:
        now, last = self._read(), self._last
        self._last = now
        if now is None or last is None or now[2] - last[2] <= 0:
            return None
        other = (now[0] - last[0]) - (now[1] - last[1])
        return max(0.0, min(1.0, other / (self._cpus * (now[2] - last[2]))))


def build_steps(
    problem: Problem, quantities: Sequence[str], backends: Sequence[str], device: str = "cpu"
) -> tuple[dict[tuple[str, str], Step], list[Result]]:
    """The plain step and one step per (backend, quantity) it supports; failures as results."""
    steps: dict[tuple[str, str], Step] = {}
    failed: list[Result] = []
    inst = Instance.of(problem, device)
    steps[("plain", PLAIN)] = PlainBackend().make_step(inst, QUANTITIES[PLAIN])
    for bname in backends:
        backend = BACKENDS[bname]
        for qname in quantities:
            quantity = QUANTITIES[qname]
            if not quantity.extended:
                continue
            try:
                inst = Instance.of(problem, device)
                step = backend.make_step(inst, quantity)
                step()  # fails early, allocates the steady-state buffers
                backend.verify(inst, quantity)
            except Unsupported as e:
                failed.append(Result(problem.name, qname, bname, error=f"n/a: {e}"))
                continue
            except Exception as e:  # noqa: BLE001  (a competitor or curvopt failing is a result)
                msg = str(e).splitlines()[0] if str(e) else ""
                failed.append(
                    Result(
                        problem.name, qname, bname, error=f"error: {type(e).__name__}: {msg[:200]}"
                    )
                )
                continue
            steps[(bname, qname)] = step
    return steps, failed


def measure(
    problem: Problem,
    quantities: Sequence[str],
    backends: Sequence[str],
    rounds: int,
    warmup: int,
    min_sample_s: float,
    max_seconds: float,
    seed: int,
    log=None,
    device: str = "cpu",
    max_other_load: float | None = None,
) -> tuple[list[Result], dict[str, float]]:
    """Interleaved timing of all steps of one problem; returns results and the plain timing.

    With ``max_other_load``, rounds during which other processes kept more than that share of
    the CPUs busy are dropped (and more rounds are run, up to 3 x ``max_seconds``).
    """
    steps, results = build_steps(problem, quantities, backends, device)
    sync = _sync(device)
    last = {}
    for _ in range(warmup):
        for key, step in steps.items():
            last[key] = _time(step, 1, sync)
    # calls per sample, per step (the fastest counts), so that a sample lasts ~min_sample_s
    inner = {key: max(1, round(min_sample_s / max(t, 1e-6))) for key, t in last.items()}
    by_key = {key: Result(problem.name, key[1], key[0]) for key in steps}
    order = list(steps)
    rng = random.Random(seed)
    other_load = OtherLoad()
    loads: list[float | None] = []
    started = time.perf_counter()
    done = 0
    gc_was_enabled = gc.isenabled()
    try:
        for r in range(rounds):
            rng.shuffle(order)
            gc.collect()
            gc.disable()
            other_load()
            sample = {key: _time(steps[key], inner[key], sync) for key in order}
            loads.append(other_load())
            if gc_was_enabled:
                gc.enable()
            done = r + 1
            quiet = max_other_load is None or loads[-1] is None or loads[-1] <= max_other_load
            if quiet:
                base = sample[("plain", PLAIN)]
                for key, t in sample.items():
                    by_key[key].times.append(t)
                    by_key[key].ratios.append(t / base)
            kept = len(by_key[("plain", PLAIN)].times)
            if time.perf_counter() - started > max_seconds and kept >= 3:
                break
            if time.perf_counter() - started > 3 * max_seconds and done >= 3:
                break  # too busy to find quiet rounds: keep what there is
    finally:
        if gc_was_enabled:
            gc.enable()
    kept = len(by_key[("plain", PLAIN)].times)
    if kept == 0:  # no quiet round at all: fall back to every round
        return measure(
            problem,
            quantities,
            backends,
            rounds,
            1,
            min_sample_s,
            max_seconds,
            seed,
            log,
            device,
            None,
        )
    measured = [x for x in loads if x is not None]
    load = statistics.median(measured) if measured else None
    if log is not None:
        log(
            f"{problem.name}: {len(steps)} steps, {kept} of {done} rounds kept, "
            f"{time.perf_counter() - started:.1f}s"
            + (f", other processes used {100 * load:.0f}% of the CPUs" if load is not None else "")
        )
    info = {
        "plain_ms": 1e3 * statistics.median(by_key[("plain", PLAIN)].times),
        "rounds": kept,
        "rounds_run": done,
        "plain_reps": inner[("plain", PLAIN)],
        "other_load_median": load,
        "other_load_per_round": loads,
    }
    return list(by_key.values()) + results, info


# ------------------------------------------------------------------------------------ report
def _cell(result: Result | None, target: float | None = None, spread=False) -> str:
    if result is None:
        return ""
    if result.error is not None:
        return "n/a" if result.error.startswith("n/a") else "error"
    text = f"{result.ratio:.2f}"
    if spread:
        q1, q3 = result.quartiles()
        text += f" ({q1:.2f}–{q3:.2f})"
    if target is not None:
        text += " ✓" if result.ratio <= target else " ✗"
    return text


def markdown_table(
    results: list[Result], infos: dict[str, dict], backends: Sequence[str], spread: bool = False
) -> str:
    """One row per (problem, quantity), one column per backend; the plain row gives its time."""
    index = {(r.problem, r.quantity, r.backend): r for r in results}
    header = ["problem", "quantity", *backends, "target (curvopt)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for problem in infos:
        plain = f"1.00 = {infos[problem]['plain_ms']:.2f} ms"
        cells = [plain] + [""] * (len(backends) - 1)
        lines.append(f"| {problem} | {QUANTITIES[PLAIN].label} | " + " | ".join(cells) + " | |")
        measured = {r.quantity for r in results if r.problem == problem}
        for q, quantity in QUANTITIES.items():
            if q == PLAIN or q not in measured:
                continue
            target = TARGETS.get((problem, q))
            cells = [
                _cell(index.get((problem, q, b)), target if b == "curvopt" else None, spread)
                for b in backends
            ]
            goal = f"≤ {target:.2f}" if target else ""
            lines.append(f"| {problem} | {quantity.label} | " + " | ".join(cells) + f" | {goal} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ profiling
def profile(
    problem_name: str,
    quantity: str,
    backend: str = "curvopt",
    steps: int = 10,
    row_limit: int = 25,
    device: str = "cpu",
) -> str:
    """torch.profiler table (self time, by op and input shape) of ``steps`` steps of one case."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    problem = PROBLEMS[problem_name]
    inst = Instance.of(problem, device)
    if quantity == PLAIN:
        step = PlainBackend().make_step(inst, QUANTITIES[PLAIN])
    else:
        step = BACKENDS[backend].make_step(inst, QUANTITIES[quantity])
    for _ in range(5):
        step()
    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch_profile(activities=activities, record_shapes=True) as prof:
        for _ in range(steps):
            step()
        _sync(device)()
    return f"{steps} steps of {problem_name}:{quantity}:{backend}\n" + prof.key_averages(
        group_by_input_shape=True
    ).table(
        sort_by="self_device_time_total" if cuda else "self_cpu_time_total", row_limit=row_limit
    )


# ------------------------------------------------------------------------------------ CLI
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m experiments.overhead", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--problems",
        nargs="+",
        default=list(dict.fromkeys(p for p, _ in DEFAULT_CASES)),
        choices=list(PROBLEMS),
    )
    p.add_argument(
        "--quantities",
        nargs="+",
        default=None,
        choices=[q for q in QUANTITIES if q != PLAIN],
        help="default: " + " ".join(dict.fromkeys(q for _, q in DEFAULT_CASES)),
    )
    p.add_argument(
        "--backends",
        nargs="+",
        default=None,
        choices=list(BACKENDS),
        help="default: every backend that is importable",
    )
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:i]")
    p.add_argument("--rounds", type=int, default=25, help="interleaved rounds (default 25)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps per case (default 3)")
    p.add_argument(
        "--min-sample-ms",
        type=float,
        default=15.0,
        help="calls of a step per sample, enough to last about this long; the fastest counts",
    )
    p.add_argument(
        "--max-seconds",
        type=float,
        default=15.0,
        help="stop a problem's rounds after this long, at least 3 rounds (default 15)",
    )
    p.add_argument(
        "--max-other-load",
        type=float,
        default=None,
        help="drop rounds in which other processes used more than this share (0-1) of the CPUs",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--spread", action="store_true", help="show the quartiles of the ratios in each cell"
    )
    p.add_argument("--json", type=Path, help="also write all timings to this JSON file")
    p.add_argument(
        "--profile",
        metavar="PROBLEM:QUANTITY[:BACKEND]",
        help="print a torch.profiler table of one case instead of the ratio table",
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)
    if args.profile:
        parts = args.profile.split(":")
        print(f"torch.set_num_threads({torch.get_num_threads()})")
        print(profile(*parts, device=args.device))
        return 0

    backends = []
    skipped = {}
    for name in args.backends or list(BACKENDS):
        reason = BACKENDS[name].available()
        if reason is None:
            backends.append(name)
        else:
            skipped[name] = reason
            log(f"backend {name} skipped: {reason}")
    if args.quantities:
        cases = [(p, q) for p in args.problems for q in args.quantities]
    else:
        cases = [(p, q) for p, q in DEFAULT_CASES + EXTRA_CASES if p in args.problems]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan

    results: list[Result] = []
    infos: dict[str, dict] = {}
    for i, pname in enumerate(args.problems):
        quantities = [q for p, q in cases if p == pname]
        res, info = measure(
            PROBLEMS[pname],
            quantities,
            backends,
            args.rounds,
            args.warmup,
            args.min_sample_ms / 1e3,
            args.max_seconds,
            args.seed + i,
            log,
            args.device,
            args.max_other_load,
        )
        results += res
        infos[pname] = info
        for r in res:
            if r.error and not r.error.startswith("n/a"):
                log(f"{pname}/{r.quantity}/{r.backend}: {r.error}")

    print(
        f"Overhead: median over interleaved rounds of (step time / plain forward+backward "
        f"time in the same round); torch {torch.__version__}, "
        f"torch.set_num_threads({torch.get_num_threads()}), "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}, float32, {args.device} "
        f"({os.cpu_count()} CPUs, load average {load:.1f} at start); rounds per problem "
        f"(and the median share of the CPUs other processes used meanwhile): "
        + ", ".join(
            f"{p} {i['rounds']}"
            + (
                f" ({100 * i['other_load_median']:.0f}%)"
                if i["other_load_median"] is not None
                else ""
            )
            for p, i in infos.items()
        )
    )
    if skipped:
        print("Not installed: " + ", ".join(skipped) + ".")
    print()
    print(markdown_table(results, infos, backends, spread=args.spread))

    if args.json:
        payload = {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "device": args.device,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "cpu_count": os.cpu_count(),
            "load_average_at_start": load,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "processor": platform.processor(),
            "backends": backends,
            "skipped_backends": skipped,
            "problems": {p: {"description": PROBLEMS[p].description, **infos[p]} for p in infos},
            "targets": {f"{p}:{q}": t for (p, q), t in TARGETS.items()},
            "results": [
                {
                    "problem": r.problem,
                    "quantity": r.quantity,
                    "backend": r.backend,
                    "ratio_median": r.ratio if r.ratios else None,
                    "ratio_q1": r.quartiles()[0] if r.ratios else None,
                    "ratio_q3": r.quartiles()[1] if r.ratios else None,
                    "time_median_ms": 1e3 * statistics.median(r.times) if r.times else None,
                    "times_ms": [1e3 * t for t in r.times],
                    "error": r.error,
                }
                for r in results
            ],
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=1))
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
