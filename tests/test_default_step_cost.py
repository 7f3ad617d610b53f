"""``benchmarks.default_step_cost``: each entry's refresh is the last step of its blocks (its
collection rests between them, so it does not wake the hooks of the other entries' models),
and ``--split`` times a block's refresh apart from its plain steps."""

from __future__ import annotations

import gc

from benchmarks import default_step_cost
from curvopt.core.state import STATE


def test_between_blocks_every_collection_rests():
    """After the first (uncounted) round, which holds ``EKFAC``'s extra refresh of its first
    basis (step 1), every armed collection in the process rests between blocks: the next step
    of each optimizer is a plain one, its refresh having ended its block."""
    gc.collect()  # (optimizers of earlier tests, freed: disarmed)
    runs = default_step_cost.entries("encoder")
    for name, run in runs.items():
        run(name, 0)
    for name, run in runs.items():
        assert STATE.plain, name
        run(name, 1)
    assert STATE.plain


def test_the_split_times_the_refresh_apart_from_the_plain_steps():
    """Every entry has the three phases of both kinds; the defaults' refresh runs the curvature
    pass (a backward several times a plain one's), ``KFAC plain``'s last step is a plain one."""
    found = default_step_cost.split("encoder", rounds=1)
    assert set(found) == {"AdamW", *default_step_cost.CURVOPT}
    for kinds in found.values():
        assert set(kinds) == {"refresh", "plain"}
        for parts in kinds.values():
            assert set(parts) == set(default_step_cost.PARTS)
            assert all(ms > 0 for ms in parts.values())
    for name in ("KFAC", "EKFAC", "DiagGGNNewton"):
        assert found[name]["refresh"]["backward_s"] > 2 * found[name]["plain"]["backward_s"]
    plain = found["KFAC plain"]
    assert plain["refresh"]["backward_s"] < found["KFAC"]["refresh"]["backward_s"] / 2
