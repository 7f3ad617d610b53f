"""Interleaved timing of the overhead benchmark's steps, profiling of one step, and the Python
calls of each step (``python_calls``).

After a warm-up (buffers allocated, steady state), each round runs every step of a problem in a
freshly shuffled order and divides each step's time by the plain step's time *of the same
round*; a step's time in a round is the fastest of a few consecutive calls (about
``min_sample_s`` worth), which discards calls hit by preemption. :class:`OtherLoad` measures how
busy other processes kept the CPUs in each round, so busy rounds can be dropped.
"""

from __future__ import annotations

import cProfile
import gc
import math
import os
import pstats
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .backends import BACKENDS, Instance, PlainBackend, Step, Unsupported
from .cases import PLAIN, QUANTITIES
from .problems import PROBLEMS, Problem


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
                inst = Instance.of(problem, device, quantity.linear_only)
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


#: ``python_calls``: steps counted, after the warm-up steps
CALL_STEPS, CALL_WARMUP = 20, 5


def python_calls(
    problem: Problem, quantities: Sequence[str], backends: Sequence[str], device: str = "cpu"
) -> dict[tuple[str, str], float]:
    """``{(backend, quantity): calls}``, the plain step's under ``("plain", PLAIN)``: the Python
    calls of one step (cProfile's count, Python functions and builtins: deterministic where
    times scatter), the mean of ``CALL_STEPS`` steps after ``CALL_WARMUP`` (plans made, buffers
    allocated); a case a backend cannot compute is left out."""
    steps, _ = build_steps(problem, quantities, backends, device)
    found = {}
    for key, step in steps.items():
        for _ in range(CALL_WARMUP):
            step()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(CALL_STEPS):
            step()
        profiler.disable()
        found[key] = sum(v[1] for v in pstats.Stats(profiler).stats.values()) / CALL_STEPS
    return found


class _OperatorCount(TorchDispatchMode):
    """Counts the ATen operators dispatched while it is active (``count``)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def torch_operators(
    problem: Problem, quantities: Sequence[str], backends: Sequence[str], device: str = "cpu"
) -> dict[tuple[str, str], float]:
    """``{(backend, quantity): operators}`` as :func:`python_calls` gives calls: the ATen
    operators one step dispatches below autograd (a ``TorchDispatchMode``'s count: views and
    host reads, ``_local_scalar_dense``, included; a composite operator counts as the
    operators it runs), the mean of ``CALL_STEPS`` steps after ``CALL_WARMUP``."""
    steps, _ = build_steps(problem, quantities, backends, device)
    found = {}
    for key, step in steps.items():
        for _ in range(CALL_WARMUP):
            step()
        with _OperatorCount() as counter:
            for _ in range(CALL_STEPS):
                step()
        found[key] = counter.count / CALL_STEPS
    return found


def profile(
    problem_name: str,
    quantity: str,
    backend: str = "curvopt",
    steps: int = 10,
    row_limit: int = 25,
    device: str = "cpu",
    batch: int | None = None,
) -> str:
    """torch.profiler table (self time, by op and input shape) of ``steps`` steps of one case,
    at the problem's own batch size or ``batch`` samples."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    problem = PROBLEMS[problem_name]
    if batch is not None:
        problem = problem.resized(batch)
    inst = Instance.of(problem, device, QUANTITIES[quantity].linear_only)
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
