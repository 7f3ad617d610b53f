"""Spawning gloo ranks for a test without flakes on a loaded machine (shared by the distributed
test files).

A test ``mp.spawn``s its ranks with :func:`spawn_ranks`; each rank's ``worker(rank, world,
outdir)`` calls :func:`join`, runs, writes its result with :func:`write_result` and ends with
:func:`leave`. What each part prevents:

* **no port race**: the ranks meet through a ``FileStore`` in the run's fresh temporary folder.
  Picking a free TCP port and binding it later lets another process take it in between.
* **no timeout under load**: collectives (and the start-up) wait ``TIMEOUT`` (300 s), since on
  a loaded 2-core machine one rank can lag the others by many seconds.
* **no abort at exit**: gloo's C++ teardown (``destroy_process_group``, or the destructors run
  at the interpreter's exit while a DDP wrapper still holds the group) aborts a process at
  random ("terminate called without an active exception", SIGABRT). :func:`leave` frees the
  garbage while the group is alive, ends every rank's last collective with a barrier, meets
  the other ranks once more in the store (a file, not a socket), and leaves by ``os._exit``
  without tearing gloo down: every rank's result is written by then, and no rank still waits
  for another's messages.
* **a readable failure**: a rank killed by a signal leaves its Python stack (``faulthandler``)
  and :func:`spawn_ranks` fails naming every rank's outcome.
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import json
import os
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp

#: how long a rank waits for the others in a collective (and at start-up) before gloo raises
#: "Timed out waiting ...": generous, since on a loaded machine one rank can lag the others
TIMEOUT = datetime.timedelta(seconds=300)


def join(rank: int, world: int, outdir: str) -> dist.FileStore:
    """Join the default group of ``world`` gloo ranks through a ``FileStore`` in ``outdir`` (a
    fresh folder per run; no TCP port is picked). A rank killed by a signal leaves its stack in
    ``outdir/rank<rank>.stack``. Returns the store (:func:`leave` meets the ranks there)."""
    stack = open(os.path.join(outdir, f"rank{rank}.stack"), "w")  # noqa: SIM115 (kept open)
    faulthandler.enable(stack, all_threads=True)
    store = dist.FileStore(os.path.join(outdir, "store"), world)
    store.set_timeout(TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=TIMEOUT)
    return store


def leave(store: dist.FileStore, rank: int, world: int) -> None:
    """End a spawned rank once every rank is done with gloo, without tearing it down (the
    module docstring); does not return."""
    gc.collect()  # DDP wrappers in reference cycles hold the group: freed while it is alive
    dist.barrier()
    store.set(f"left{rank}", "1")
    store.wait([f"left{r}" for r in range(world)])
    os._exit(0)


def run_rank(rank: int, world: int, outdir: str, body) -> None:
    """A whole spawned rank: :func:`join`, ``body(rank, world)`` (a JSON-able result, written to
    ``outdir/rank<rank>.json`` as ``{"ok": result}``, or ``{"error": traceback}`` before the
    exception propagates to ``mp.spawn``), :func:`leave`."""
    store = join(rank, world, outdir)
    try:
        result = {"ok": body(rank, world)}
    except BaseException:
        _write(outdir, rank, {"error": traceback.format_exc()})
        raise  # mp.spawn reports it with its traceback
    _write(outdir, rank, result)
    leave(store, rank, world)


def _write(outdir: str, rank: int, result: dict) -> None:
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def outcome(outdir: str, rank: int) -> str:
    """What rank ``rank`` left: its error, or its stack where it died without writing one."""
    path = os.path.join(outdir, f"rank{rank}.json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f).get("error", "finished")
    stack = os.path.join(outdir, f"rank{rank}.stack")
    if not os.path.exists(stack):
        return "failed before it started (see the error above)"
    with open(stack) as f:
        return "killed before writing a result; its stack:\n" + (f.read() or "(none)")


def spawn_ranks(world: int, outdir: str, worker) -> list:
    """``mp.spawn(worker, (world, outdir))`` and every rank's result (:func:`run_rank`); a rank
    that fails (an exception, a collective that timed out after ``TIMEOUT``, a signal) fails
    with every rank's outcome in the message."""
    try:
        mp.spawn(worker, args=(world, outdir), nprocs=world, join=True)
    except (mp.ProcessExitedException, mp.ProcessRaisedException) as error:
        outcomes = "\n".join(f"rank {r}: {outcome(outdir, r)}" for r in range(world))
        raise AssertionError(
            f"{world} gloo ranks failed ({error}; collectives time out after {TIMEOUT}):\n"
            f"{outcomes}"
        ) from error
    results = []
    for rank in range(world):
        with open(os.path.join(outdir, f"rank{rank}.json")) as f:
            result = json.load(f)
        assert "ok" in result, result.get("error")
        results.append(result["ok"])
    return results
