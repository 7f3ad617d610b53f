"""Peak memory of the overhead benchmark's cases, each (problem, quantity, backend) in a fresh
process (a child of the same python), so that no case sees another's allocations.

In the child: run the backend's step once on a batch of one (or two) and drop it (one-time costs
such as lazy imports and compiled functions, tens of MB for some backends, are not the
quantity's), build the problem, run one plain forward+backward on it, read the resident set
``VmRSS``, reset the peak (``5`` into ``/proc/self/clear_refs`` resets ``VmHWM`` on Linux), then
build the backend's step and run it twice. ``peak_mb`` is the highest ``VmHWM`` of the two calls
minus that ``VmRSS``, in MB (10⁶ bytes): the extra resident memory the quantity costs over the
built problem, results and cached buffers included (what a training loop's process needs).
``steady_mb`` is that of the second call alone (the peak is reset between the calls): a training
loop's steady state, with the first call's results still held; it is lower where the first call
at a new shape allocates transient work space.

``tracemalloc`` does not see torch's allocator, hence resident-set accounting. glibc keeps freed
blocks below its (adaptive) mmap threshold resident and reuses them, which would hide a peak
behind memory an earlier phase freed; the child runs with ``MALLOC_MMAP_THRESHOLD_`` fixed at
64 KiB, so every tensor buffer of any size is mapped on allocation and returned on free.
"""

from __future__ import annotations

import gc
import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .backends import BACKENDS, Instance, PlainBackend, Unsupported
from .cases import PLAIN, QUANTITIES
from .problems import PROBLEMS

_ROOT = Path(__file__).resolve().parents[2]
_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"
#: the environment of a measuring child (see the module docstring)
CHILD_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "OMP_WAIT_POLICY": "PASSIVE"}
MB = 1e6


@dataclass
class MemoryResult:
    problem: str
    quantity: str
    backend: str
    peak_mb: float | None = None
    steady_mb: float | None = None
    error: str | None = None


def _status_kb(field: str) -> int:
    with open(_STATUS) as f:
        match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    if match is None:
        raise OSError(f"no {field} in {_STATUS}")
    return int(match.group(1))


def reset_peak() -> None:
    """Set this process's ``VmHWM`` to its current ``VmRSS`` (Linux)."""
    with open(_CLEAR_REFS, "w") as f:
        f.write("5")


def unsupported_reason() -> str | None:
    """Why peak memory cannot be measured here (no resettable ``VmHWM``), or None."""
    try:
        reset_peak()
        _status_kb("VmHWM")
        _status_kb("VmRSS")
    except OSError as e:
        return f"needs Linux's /proc/self/clear_refs and VmHWM ({type(e).__name__}: {e})"
    return None


def peak_mb(run: Callable[[], object]) -> float:
    """Peak resident memory of ``run()`` above the resident memory before it, in MB."""
    before = _status_kb("VmRSS")
    reset_peak()
    run()
    return (_status_kb("VmHWM") - before) * 1024 / MB


def _pay_one_time_costs(backend, problem, quantity) -> None:
    """Run the step once on a batch of one (of two where one sample is ambiguous, e.g. a
    sequence model whose T loss rows could be T samples) and drop it: lazy imports, compiled
    functions and thread pools are then paid for. A case that fails on both raises later."""
    for n in (1, 2):
        try:
            small = Instance.of(problem.resized(n), linear_only=quantity.linear_only)
            backend.make_step(small, quantity)()
            return
        except Exception:  # noqa: BLE001, S112  (the measured case reports the error)
            continue
        finally:
            small = None
            gc.collect()


def _case_peak(spec: dict) -> dict:
    """In the child: the peaks of two steps of one case (module docstring)."""
    torch.set_num_threads(spec["threads"])
    problem = PROBLEMS[spec["problem"]]
    if spec.get("batch"):
        problem = problem.resized(spec["batch"])
    plain = spec["backend"] == PLAIN
    quantity = QUANTITIES[PLAIN if plain else spec["quantity"]]
    backend = PlainBackend() if plain else BACKENDS[spec["backend"]]
    _pay_one_time_costs(backend, problem, quantity)
    inst = Instance.of(problem, linear_only=quantity.linear_only)
    PlainBackend().make_step(inst, QUANTITIES[PLAIN])()
    inst.model.zero_grad(set_to_none=True)

    before = _status_kb("VmRSS")
    reset_peak()
    step = backend.make_step(inst, quantity)
    step()
    first = _status_kb("VmHWM")
    reset_peak()
    step()
    steady = _status_kb("VmHWM")
    backend.verify(inst, quantity)  # e.g. BackPACK skipping a module it has no rule for
    return {
        "peak_mb": (max(first, steady) - before) * 1024 / MB,
        "steady_mb": (steady - before) * 1024 / MB,
    }


def _child(spec: dict) -> dict:
    """Run one measurement in this process; ``{"peak_mb": ...}`` or ``{"error": ...}``."""
    try:
        if "allocate_mb" in spec:  # a known answer, for the tests
            n = int(spec["allocate_mb"] * MB) // 4
            return {"peak_mb": peak_mb(lambda: torch.ones(n, dtype=torch.float32).sum())}
        return _case_peak(spec)
    except Unsupported as e:
        return {"error": f"n/a: {e}"}
    except Exception as e:  # noqa: BLE001  (a backend failing is a result)
        msg = str(e).splitlines()[0] if str(e) else ""
        return {"error": f"error: {type(e).__name__}: {msg[:200]}"}


def run_child(spec: dict, timeout: float = 1800.0) -> dict:
    """Measure ``spec`` in a fresh ``python -m experiments.overhead.memory`` process."""
    env = {**os.environ, **CHILD_ENV, "OMP_NUM_THREADS": str(spec.get("threads", 1))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.overhead.memory", json.dumps(spec)],
        cwd=_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"error: child exited {proc.returncode}: {tail[:200]}"}
    return json.loads(lines[-1])


def measure_memory(
    problem: str,
    quantities: Sequence[str],
    backends: Sequence[str],
    threads: int,
    batch: int | None = None,
    log=None,
) -> list[MemoryResult]:
    """Peak MB of the plain step and of every (quantity, backend), each in its own process."""
    jobs = [(PLAIN, PLAIN)] + [(q, b) for q in quantities for b in backends]
    out = []
    for quantity, backend in jobs:
        spec = {"problem": problem, "quantity": quantity, "backend": backend}
        spec.update(threads=threads, batch=batch)
        res = run_child(spec)
        out.append(
            MemoryResult(
                problem,
                quantity,
                backend,
                res.get("peak_mb"),
                res.get("steady_mb"),
                res.get("error"),
            )
        )
        if log is not None:
            what = res.get("error") or f"{res['peak_mb']:.1f} MB (steady {res['steady_mb']:.1f})"
            log(f"memory {problem}/{quantity}/{backend}: {what}")
    return out


def ratio(mine: MemoryResult | None, theirs: MemoryResult | None) -> float | None:
    """``mine / theirs`` peak (None if either is missing or not positive)."""
    if mine is None or theirs is None or not mine.peak_mb or not theirs.peak_mb:
        return None
    if theirs.peak_mb <= 0 or math.isnan(theirs.peak_mb):
        return None
    return mine.peak_mb / theirs.peak_mb


if __name__ == "__main__":
    print(json.dumps(_child(json.loads(sys.argv[1]))))
