"""``benchmarks.refresh_parts`` times a refresh's backward apart from the plain steps', by the
engine functions it names, and puts them back."""

from __future__ import annotations

import importlib

import pytest

from benchmarks import refresh_parts
from benchmarks.per_pass_parts import PARTS


def _resolve(module, path):
    owner = importlib.import_module(module)
    for part in path.split("."):
        owner = getattr(owner, part)
    return owner


@pytest.mark.parametrize("optimizer", refresh_parts.OPTIMIZERS)
def test_the_refresh_is_timed_by_part_and_the_functions_put_back(optimizer):
    labelled = (*PARTS, *refresh_parts.REFRESH_PARTS)
    before = {label: _resolve(module, path) for label, module, path in labelled}
    refresh, plain, timed = refresh_parts.parts("encoder", optimizer, rounds=1)
    assert refresh > plain > 0  # (the times of one round on a shared host: no finer claim)
    assert set(timed) == set(before)
    assert timed["  curvature pass"] > timed["    Kronecker output sides"] > 0
    assert timed["    columns propagated"] > 0
    s_part = timed["  EKFAC's S from the module hooks"]
    assert s_part > 0 if optimizer == "EKFAC" else s_part == 0
    assert refresh > timed["loss hook"]
    for label, module, path in labelled:
        assert _resolve(module, path) is before[label], label
