"""Calls follow the imports: a record is data, and the gradient hooks reach the passes through
the module that makes them (``routing``); ``hessian`` and ``kfra`` read one frozen
``LossContext``, not the curvature pass."""

import dataclasses
import inspect
import pathlib

import pytest

import curvopt
from curvopt.engine import hessian, kfra
from curvopt.engine.loss_context import LossContext

ROOT = pathlib.Path(curvopt.__file__).parent


@pytest.mark.parametrize("path", ["core/records.py", "frontend/hooks.py", "entry/recognize.py"])
def test_no_reach_for_the_pass_through_the_global_state(path):
    assert "backward_pass(" not in (ROOT / path).read_text()


def test_only_routing_asks_for_the_pass():
    askers = {
        p.relative_to(ROOT).as_posix()
        for p in ROOT.rglob("*.py")
        if "ROUTER.backward_pass(" in p.read_text()
        or "collecting.backward_pass(" in p.read_text()
    }
    assert askers == {"loop/routing.py"}


def test_hessian_and_kfra_take_the_loss_context():
    assert dataclasses.is_dataclass(LossContext) and LossContext.__dataclass_params__.frozen
    fields = {f.name for f in dataclasses.fields(LossContext)}
    assert fields == {"output", "walk", "batched", "exact_columns"}
    assert list(inspect.signature(hessian.residuals).parameters)[0] == "context"
    assert list(inspect.signature(kfra.kfra).parameters)[0] == "context"
