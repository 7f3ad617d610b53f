"""Where the backward of an optimizer's curvature refresh goes, at the defaults, by part.

    OMP_NUM_THREADS=1 python -m benchmarks.refresh_parts [--rounds 3] [--models resnet gpt]

The networks, batches and optimizers of ``benchmarks.default_step_cost`` (``KFAC``, ``EKFAC``
built as a user builds them); ``rounds`` blocks of its 30 steps each. The parts are the engine
functions of ``benchmarks.per_pass_parts`` (wrapped with ``time.perf_counter`` for the run,
about 1 µs a call) and the refresh's own (:data:`REFRESH_PARTS`: the coupled batch gradients
of the columns, ``EKFAC``'s ``S``, the first-order sums the checks compare); parts nest, so they
do not add up, and a part's time includes its torch operators. A step is a refresh where its
backward ran a curvature pass (a plain step's hooks return at once). Printed: the backward of
a refresh and of a plain step (medians, ms of real time), and each part's ms per refresh (its
mean over the refreshes), the guards' parts summed.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch

from benchmarks import default_step_cost
from benchmarks.per_pass_parts import GUARD, PARTS, _timed

#: (label, module, attribute path) of the parts a refresh adds to :data:`PARTS`
REFRESH_PARTS = (
    (
        "    batch gradients of the columns (coupled)",
        "curvopt.engine.kron_pass",
        "batch_column_grads",
    ),
    ("  EKFAC's S from the module hooks", "curvopt.engine.reducer", "FirstOrderReducer._correct"),
    ("  sums the checks compare", "curvopt.engine.reducer", "FirstOrderReducer.add_total"),
    (
        "EKFAC's S from the columns (coupled)",
        "curvopt.engine.reducer",
        "FirstOrderReducer.correct_columns",
    ),
)
#: the part whose time grows only in a refresh (a plain step runs no curvature pass)
CURVATURE_PASS = "  curvature pass"
OPTIMIZERS = ("KFAC", "EKFAC")


def parts(model_name: str, optimizer: str, rounds: int) -> tuple:
    """``(refresh ms, plain ms, {part: ms per refresh})``: the backward of ``optimizer``'s
    refreshes and plain steps on ``model_name`` (medians), each part's mean per refresh."""
    made, batches = default_step_cost.setups(model_name)
    model, lossfunc, opt = made[optimizer]
    totals: collections.Counter = collections.Counter()
    labelled = (*PARTS, *REFRESH_PARTS)
    wrapped = [_timed(totals, *part) for part in labelled]
    refreshes, plains, seen = [], [], collections.Counter()
    try:
        for _ in range(rounds):
            for X, y in batches:
                opt.zero_grad()
                loss = lossfunc(model(X), y)
                before = totals.copy()
                start = time.perf_counter()
                with opt.collect():
                    loss.backward()
                elapsed = time.perf_counter() - start
                opt.step()
                if totals[CURVATURE_PASS] > before[CURVATURE_PASS]:
                    refreshes.append(elapsed)
                    seen.update(totals - before)
                else:
                    plains.append(elapsed)
    finally:
        for owner, name, original in reversed(wrapped):
            setattr(owner, name, original)
    count = max(1, len(refreshes))
    timed = {label: 1e3 * seen.get(label, 0.0) / count for label, *_ in labelled}
    return 1e3 * statistics.median(refreshes), 1e3 * statistics.median(plains), timed


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--models",
        nargs="+",
        default=list(default_step_cost.MODELS),
        choices=list(default_step_cost.MODELS),
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for model_name in args.models:
        for optimizer in OPTIMIZERS:
            refresh, plain, timed = parts(model_name, optimizer, args.rounds)
            guards = sum(ms for label, ms in timed.items() if label.strip().startswith(GUARD))
            print(
                f"\n{model_name} {optimizer}: a refresh's backward {refresh:.1f} ms, "
                f"a plain one {plain:.1f} ms (ms per refresh)"
            )
            for label, ms in (*timed.items(), ("the guards' parts, summed", guards)):
                if ms >= 0.05:
                    print(f"{ms:8.1f} ms  {label}")


if __name__ == "__main__":
    main()
