"""``benchmarks.per_pass_parts`` times the engine functions it names, and puts them back."""

from __future__ import annotations

import importlib

import pytest

from benchmarks import per_pass_parts


def _resolve(module, path):
    owner = importlib.import_module(module)
    for part in path.split("."):
        owner = getattr(owner, part)
    return owner


@pytest.mark.parametrize("model", list(per_pass_parts.MODELS))
def test_every_part_names_an_engine_function_and_is_restored(model):
    before = {label: _resolve(module, path) for label, module, path in per_pass_parts.PARTS}
    passed, plain, timed = per_pass_parts.parts("BatchGrad", batch=2, repeats=3, model=model)
    assert passed > 0 and plain > 0
    for label in ("forward hooks", "loss hook", "module hooks", "end of pass"):
        assert timed[label] > 0, label
    for label in ("  first-order reducer", "  guard: checks at the end"):
        assert timed[label] > 0, label
    assert timed["  curvature pass"] == 0  # first order only
    for label, module, path in per_pass_parts.PARTS:
        assert _resolve(module, path) is before[label], label
