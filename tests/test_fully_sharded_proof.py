"""The cheap proof that no module is ``fully_shard``-ed (``core.sharded.any_fully_sharded``),
which lets a pass skip its walks of the models' modules for FSDP2's: it holds exactly while no
class derived from ``FSDPModule`` is alive, and a pass without one writes what the walks would
(the passes with ``fully_shard`` run in ``tests/test_fsdp2.py``)."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest
from torch import nn

from curvopt.core import sharded

FSDPModule = pytest.importorskip("torch.distributed.fsdp").FSDPModule

#: a fresh process: no ``fully_shard`` yet, so no walk; the per-sample gradients of a pass
#: match torch.func's in float64 all the same
_FRESH = """
import torch
from torch import nn
import curvopt
from curvopt import extensions as ext
from curvopt.core import sharded

assert not sharded.any_fully_sharded()
torch.manual_seed(0)
model = curvopt.extend(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double())
x, y = torch.randn(5, 3, dtype=torch.float64), torch.randint(0, 2, (5,))
lossfunc = curvopt.extend(nn.CrossEntropyLoss(reduction="sum"))
with curvopt.collect(ext.BatchGrad()):
    lossfunc(model(x), y).backward()
params = dict(model.named_parameters())
def loss_of(p, xn, yn):
    out = torch.func.functional_call(model, p, (xn[None],))
    return lossfunc(out, yn[None])
ref = torch.func.vmap(torch.func.grad(loss_of), in_dims=(None, 0, 0))(params, x, y)
for name, p in params.items():
    assert torch.allclose(p.grad_batch, ref[name], rtol=1e-12, atol=1e-12), name
assert not sharded.any_fully_sharded()
print("ok")
"""


def test_a_fresh_process_walks_no_module_and_writes_the_same():
    result = subprocess.run(
        [sys.executable, "-c", _FRESH], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_a_class_derived_from_fsdp_module_makes_the_walks_run(monkeypatch):
    """``fully_shard`` derives a class of ``FSDPModule`` and the module's own: while one is
    alive the proof fails, and the walk finds its modules."""
    # (``FSDPModule.__new__`` expects ``fully_shard``'s own classes: a plain one here)
    derived = type("FSDPLinearForTest", (FSDPModule, nn.Linear), {"__new__": _plain_new})
    assert sharded.any_fully_sharded()
    sharded_linear = derived(2, 2)
    model = nn.Sequential(nn.Linear(2, 2), sharded_linear)
    walked = []
    monkeypatch.setattr(sharded, "_param_groups", lambda module: walked.append(module) or [])
    assert sharded.sharded_index([model]) == {}
    assert walked == [sharded_linear]


def _plain_new(cls, *args, **kwargs):
    return object.__new__(cls)


def test_the_proof_reads_the_classes_alive():
    """The proof is no cached verdict: a class freed no longer counts."""
    derived = type("FSDPReLUForTest", (FSDPModule, nn.ReLU), {})
    assert sharded.any_fully_sharded()
    del derived
    gc.collect()
    alive = [cls.__name__ for cls in FSDPModule.__subclasses__()]
    assert "FSDPReLUForTest" not in alive
    assert sharded.any_fully_sharded() == bool(alive)
