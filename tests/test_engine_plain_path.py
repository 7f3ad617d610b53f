"""The plain path is plain, and one loss's calls follow the imports (``benchmarks.call_trace``).

* a KFAC step on a two-layer MLP runs no broadcast, compression or checkpoint code (the walk met
  no checkpoint, so ``propagate`` does not ask about live segments);
* the calls that pass one loss on through the engine, from the loss hook, come back to an
  engine module they left at most 5 times, for every second-order producer, on the first pass
  of a structure (row probes) and on later ones;
* the Kronecker factors of ``KFLR`` and ``KFAC`` (issue 64's route) enter at most 14 modules,
  coming back at most twice, on both passes.
"""

import pytest

from benchmarks import call_trace

MAX_COMEBACKS = 5
#: (module entries, comebacks) at most, of the routes issue 64 bounds
ROUTE_BOUNDS = {"KFLR": (14, 2), "KFAC": (14, 2)}


def test_a_plain_mlp_step_runs_no_special_case():
    found = call_trace.files_of_a_step()
    assert "graph/walk.py" in found and "engine/curvature.py" in found  # the trace saw the pass
    assert "graph/broadcast.py" not in found
    assert "engine/compress.py" not in found
    assert "graph/checkpointing.py" not in found


@pytest.mark.parametrize(
    "quantity, first",
    [
        (quantity, first)
        for quantity in ("KFAC", "KFLR", "DiagGGNExact", "DiagHessian", "KFRA")
        for first in (True, False)
    ],
)
def test_one_loss_comes_back_to_a_module_at_most_5_times(quantity, first):
    calls = call_trace.trace(quantity, first).calls
    merged = call_trace.sequence(calls)
    assert merged[0] == "backward" and len(merged) > 3  # the trace saw the pass
    assert call_trace.comebacks(merged) <= MAX_COMEBACKS, " -> ".join(merged)


@pytest.mark.parametrize("first", [True, False])
@pytest.mark.parametrize("quantity", sorted(ROUTE_BOUNDS))
def test_the_kronecker_route_is_short(quantity, first):
    merged = call_trace.sequence(call_trace.trace(quantity, first).calls)
    entries, comebacks = ROUTE_BOUNDS[quantity]
    assert merged[0] == "backward" and "kron_pass" in merged  # the trace saw the factors made
    assert len(merged) <= entries and call_trace.comebacks(merged) <= comebacks, " -> ".join(merged)
