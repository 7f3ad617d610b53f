"""curvopt under FSDP2 (``torch.distributed.fsdp.fully_shard``): quantities and optimizer steps.

2 and 4 gloo ranks on 127.0.0.1 are spawned once per world size; every rank runs all scenarios
below in float64 on its shard of one global batch, computes the single-process reference itself
(the same seeded model, unsharded), and writes the largest deviations to a JSON file that the
tests read. With 4 ranks the layers' rows do not divide evenly (10 rows: 3, 3, 3, 1; 5 rows:
2, 2, 1, 0), so FSDP2's padded and empty shards are covered. Each rank also reports what its
optimizer state holds, so that the tests check that every layer's curvature is kept by its
owner rank alone (``KFAC``, ``DiagGGNNewton``) and that the ranks' states add up to one
process's.

Teardown (a rank's process used to die of SIGABRT, "terminate called without an active
exception", at the interpreter's exit after ``destroy_process_group``): every rank frees its
FSDP2 modules (``gc.collect()``) while the group is alive, meets the others at a barrier,
destroys the group and leaves with ``os._exit(0)``, past the interpreter's teardown.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import re
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

import curvopt
from curvopt import extensions as ext
from curvopt.core.sharded import sharded_index
from curvopt.optim import EKFAC, KFAC, DiagGGNNewton, VarianceAdaptedSGD
from curvopt.optim.distributed import state_nbytes
from curvopt.optim.distributed.fsdp import local_rows
from curvopt.optim.distributed.owners import owners_of
from distributed_harness import run_rank, spawn_ranks
from fixtures.sharded_models import N, build, global_batch, rank_shard, shard

FIRST_ORDER = ("grad_batch", "batch_l2", "sum_grad_squared", "variance")


class Rank:
    def __init__(self, rank: int, world: int, outdir: str = ""):
        self.rank, self.world, self.outdir = rank, world, outdir

    def mine(self, X, y):
        """This rank's contiguous shard of a global batch."""
        return rank_shard(X, y, self.rank, self.world)


# ----------------------------------------------------------------------------- scenarios
def _quantities(rank: Rank, order: str) -> dict:
    """First-order quantities of the rank's samples under FSDP2 (``extend`` before or after
    ``fully_shard``) against a per-sample loop (``grad_batch``) and one process."""
    reference, model = build("mlp"), build("mlp")
    if order == "before":
        curvopt.extend(model)
    shard(model, "mlp")
    if order == "after":
        curvopt.extend(model)
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    X, y = rank.mine(*global_batch("mlp"))
    exts = (ext.BatchGrad(), ext.BatchL2Grad(), ext.SumGradSquared(), ext.Variance())
    with curvopt.collect(*exts):
        lossfunc(model(X), y).backward()
    curvopt.extend(reference)
    with curvopt.collect(*exts):
        lossfunc(reference(X), y).backward()
    loop = []  # independent: one backward pass per sample of the mean loss's terms
    for n in range(X.shape[0]):
        loss = nn.functional.cross_entropy(reference(X[n : n + 1]), y[n : n + 1]) / X.shape[0]
        loop.append(torch.autograd.grad(loss, list(reference.parameters())))
    out = {"types": [], "loop": 0.0, "local_rows": 0.0}
    for attr in FIRST_ORDER:
        out[attr] = 0.0
    for i, (p, q) in enumerate(zip(model.parameters(), reference.parameters())):
        out["types"].append(type(p).__name__)
        for attr in FIRST_ORDER:
            out[attr] = max(out[attr], float((getattr(p, attr) - getattr(q, attr)).abs().max()))
        per_sample = torch.stack([grads[i] for grads in loop])
        out["loop"] = max(out["loop"], float((p.grad_batch - per_sample).abs().max()))
        # the samples' sum averaged over the ranks, at the rank's rows: FSDP2's own gradient
        average = p.grad_batch.sum(0)
        dist.all_reduce(average)
        mine = local_rows(p, average / rank.world)
        out["local_rows"] = max(out["local_rows"], _deviation(mine, p.grad.to_local()))
    with pytest.raises(ValueError, match="is not a quantity of a parameter") as bad:
        local_rows(next(model.parameters()), torch.zeros(3, 2))
    out["bad_rows"] = str(bad.value)
    # no quantity is left on FSDP2's gathered parameters: all went to the sharded ones
    gathered = sharded_index([model])
    out["gathered"] = len(gathered)
    out["left_on_gathered"] = sum(
        attr in p.__dict__ for p in _gathered_params(model) for attr in FIRST_ORDER
    )
    return out


def _tied_reductions(rank: Rank) -> dict:
    """The tied GPT's reduced first-order quantities (without ``grad_batch``, so that a
    parameter used once is reduced call by call) under FSDP2 against one process on the
    rank's samples: the tied weight's sum its two uses' per-sample gradients before squaring."""
    reference, model = build("gpt"), build("gpt")
    curvopt.extend(model)
    shard(model, "gpt")
    curvopt.extend(reference)
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    X, y = rank.mine(*global_batch("gpt"))
    attrs = ("batch_l2", "sum_grad_squared", "variance")
    exts = (ext.BatchL2Grad(), ext.SumGradSquared(), ext.Variance())
    for net in (model, reference):
        with curvopt.collect(*exts):
            lossfunc(net(X), y).backward()
    return {
        attr: max(
            _deviation(getattr(p, attr), getattr(q, attr))
            for p, q in zip(model.parameters(), reference.parameters())
        )
        for attr in attrs
    }


def _deviation(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a − b|`` (0 for empty tensors: a rank's empty shard)."""
    return float((a - b).abs().max()) if a.numel() else 0.0


def _gathered_params(model):
    """FSDP2's gathered (unsharded) parameters of ``model`` (private: read to check them)."""
    found = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                found += [fp._unsharded_param for fp in group.fsdp_params]
    return found


OPTIMIZERS = {
    # KFLR: exact factors, deterministic (MC factors would differ between the ranks' draws)
    "kfac": lambda params, **kw: KFAC(
        params, lr=0.2, damping=1e-2, curvature="kflr", momentum=0.5, weight_decay=1e-3, **kw
    ),
    "kfac_exact_damping": lambda params, **kw: KFAC(
        params, lr=0.2, damping=1e-2, curvature="kflr", kronecker_damping="exact", **kw
    ),
    "diag_ggn": lambda params, **kw: DiagGGNNewton(
        params, lr=0.2, damping=1e-2, curvature="exact", momentum=0.5, **kw
    ),
    # the bases of the last refresh's averaged factors (a new basis every step, or every
    # other), supplied to each rank's pass for the sharded parameter: every rank's S in one basis
    "ekfac": lambda params, **kw: EKFAC(
        params, lr=0.2, damping=1e-2, curvature="kflr", momentum=0.5, basis_interval=1, **kw
    ),
    "ekfac_interval2": lambda params, **kw: EKFAC(
        params, lr=0.2, damping=1e-2, curvature="kflr", basis_interval=2, **kw
    ),
}


#: steps per model: the GPT one (its tied weight's step is approximate, see the test)
STEPS = {"mlp": 2, "cnn": 2, "gpt": 1}
#: EKFAC's steps: the identity basis at step 0, the basis of step 0's averaged factors at step
#: 1, at step 2 that of step 1's (``basis_interval=1``) or still step 0's; the GPT's 2
EKFAC_STEPS = {"mlp": 3, "cnn": 3, "gpt": 2}
#: the GPT's EKFAC step in the bases of averaged factors: the eigenvectors of its nearly equal
#: eigenvalues turn the factors' round-off (the ranks' sums in another order) into 1.5e-12 of
#: the step; one process on the same batch with its samples reversed differs by 8e-13
EIGENBASIS_TOL = 1e-10


def _optimizer(rank: Rank, name: str, optimizer: str) -> dict:
    """``STEPS`` steps under FSDP2 against one process on the concatenated batch: each
    parameter's largest deviation after the last, and the largest after the first
    (``first_step``). The GPT's trust region is off (``kl_clip=None``): its
    factor, a sum over the group, would carry the tied weight's deviation to every one."""
    reference, model = build(name), build(name)
    curvopt.extend(model)
    shard(model, name)
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    options = {"kl_clip": None} if name == "gpt" else {}
    opt = OPTIMIZERS[optimizer](model.parameters(), **options)
    curvopt.extend(reference)
    opt_reference = OPTIMIZERS[optimizer](reference.parameters(), process_group=False, **options)
    X, y = global_batch(name)
    X_mine, y_mine = rank.mine(X, y)
    first = None  # the largest deviation after the first step
    for _ in range((EKFAC_STEPS if optimizer.startswith("ekfac") else STEPS)[name]):
        for net, o, inputs, targets in (
            (model, opt, X_mine, y_mine),
            (reference, opt_reference, X, y),
        ):
            o.zero_grad()
            with o.collect():
                lossfunc(net(inputs), targets).backward()
            o.step()
        deviations = {
            n: float((p.full_tensor() - q).detach().abs().max())
            for (n, p), q in zip(model.named_parameters(), reference.parameters())
        }
        first = max(deviations.values()) if first is None else first
    start = dict(build(name).named_parameters())
    deviations["tied_step"] = (
        float((reference.tok.weight - start["tok.weight"]).abs().max()) if name == "gpt" else 0.0
    )
    state = {**_state_layout(rank, model, opt), "one_process": state_nbytes(opt_reference.state)}
    return {**deviations, "first_step": first, "state": state}


def _state_layout(rank: Rank, model, opt) -> dict:
    """What this rank's optimizer state holds of each parameter (its keys, the shape of its
    momentum, its shard's shape), the owner ``owners_of`` names, and the bytes held."""
    params = list(model.parameters())
    layout = {
        "owners": owners_of(params, rank.world),
        "keys": [sorted(opt.state.get(p, {})) for p in params],
        "momentum": [
            list(opt.state.get(p, {}).get("momentum", torch.zeros(0)).shape) for p in params
        ],
        "shard": [list(p.to_local().shape) for p in params],
        "bytes": state_nbytes(opt.state),
    }
    total = torch.tensor([layout["bytes"]], dtype=torch.int64)
    dist.all_reduce(total)
    return {**layout, "bytes_all_ranks": int(total)}


def _two_dimensional_mesh(rank: Rank) -> str:
    """HSDP (``fully_shard`` on a ``(1, K)`` mesh: replicated, then sharded): the step raises
    on every rank before anything is changed; the error's text."""
    mesh = init_device_mesh("cpu", (1, rank.world), mesh_dim_names=("replicate", "shard"))
    model = build("mlp")
    fully_shard(model, mesh=mesh)
    curvopt.extend(model)
    before = [p.full_tensor().clone() for p in model.parameters()]
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    opt = OPTIMIZERS["kfac"](model.parameters())
    X, y = rank.mine(*global_batch("mlp"))
    with opt.collect():
        lossfunc(model(X), y).backward()
    with pytest.raises(NotImplementedError) as error:
        opt.step()
    unchanged = all(torch.equal(b, p.full_tensor()) for b, p in zip(before, model.parameters()))
    return str(error.value) + ("" if unchanged else " (parameters changed)")


#: resumed runs: ``KFAC`` with the relative damping (its scale frozen at the first refresh,
#: summed over the owners), ``DiagGGNNewton`` with the default (``s`` read at each refresh), the
#: inverses cached for ``curvature_interval=10`` steps, the factors' EMA, momentum
RESUMED = {
    "kfac": lambda params: KFAC(
        params,
        lr=0.1,
        curvature="kflr",
        curvature_ema=0.9,
        momentum=0.5,
        kl_clip=None,
        relative_damping=0.03,
        curvature_interval=10,
    ),
    "diag_ggn": lambda params: DiagGGNNewton(
        params, lr=0.1, curvature="exact", curvature_ema=0.9, momentum=0.5
    ),
}
#: the curvature is collected and inverted at steps 0, 10 and 20; saved after step 15, when the
#: EMA no longer gives the damping scale frozen at step 0 (a lost scale, step counter or EMA
#: changes the steps after: 1e-3 and more)
SAVED_AT, RESUMED_UNTIL = 15, 22


def _steps(rank: Rank, model, opt, steps: range) -> list:
    """``steps`` of ``opt`` on the rank's shard of a batch per step; the whole parameters
    after each."""
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    X, y = global_batch("mlp")
    after = []
    for step in steps:
        order = torch.randperm(N, generator=torch.Generator().manual_seed(step))
        X_mine, y_mine = rank.mine(X[order], y[order])
        opt.zero_grad()
        with opt.collect():
            lossfunc(model(X_mine), y_mine).backward()
        opt.step()
        after.append([p.full_tensor().detach().clone() for p in model.parameters()])
    return after


def optimizer_key() -> str:
    """The checkpoint's item of this rank's optimizer state (each rank keeps its own part)."""
    return f"optimizer_rank{dist.get_rank()}"


def save_checkpoint(model, opt, path: str) -> None:
    """The recipe of docs/distributed.md#fsdp2: the model's sharded state (DTensors, each rank
    its shard) and the optimizer's own ``state_dict`` (each rank's part: its layers' state and
    its rows of momentum; one item per rank) saved by ``torch.distributed.checkpoint``."""
    state = {**get_model_state_dict(model), optimizer_key(): opt.state_dict()}
    # (flattening would rebuild the optimizer's dict without its empty dicts)
    planner = DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    dcp.save(state, checkpoint_id=path, planner=planner)


def load_checkpoint(model, opt, path: str) -> None:
    """The counterpart of :func:`save_checkpoint`, into a model sharded as the saved one and an
    optimizer made as it was (the same parameters, in the same order)."""
    state = {**get_model_state_dict(model), optimizer_key(): {}}
    # (flattening would copy the dict, and load the optimizer's item into the copy)
    planner = DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    dcp.load(state, checkpoint_id=path, planner=planner)
    optimizer_state = state.pop(optimizer_key())
    set_model_state_dict(model, state)
    opt.load_state_dict(optimizer_state)


def _resumed(rank: Rank, optimizer: str) -> dict:
    """A run saved after step ``SAVED_AT`` with ``torch.distributed.checkpoint`` (the sharded
    model state and the optimizer's own ``state_dict``), loaded into a fresh model and
    optimizer, against the uninterrupted run: the largest deviation of the steps after it,
    and whether they are equal bit for bit."""
    model = curvopt.extend(build("mlp"))
    shard(model, "mlp")
    opt = RESUMED[optimizer](model.parameters())
    _steps(rank, model, opt, range(SAVED_AT))
    path = os.path.join(rank.outdir, f"checkpoint_{optimizer}")
    save_checkpoint(model, opt, path)
    uninterrupted = _steps(rank, model, opt, range(SAVED_AT, RESUMED_UNTIL))
    fresh = curvopt.extend(build("mlp"))
    shard(fresh, "mlp")
    with torch.no_grad():  # nothing of the run left in the fresh model
        for p in fresh.parameters():
            p.to_local().normal_()
    opt_fresh = RESUMED[optimizer](fresh.parameters())
    load_checkpoint(fresh, opt_fresh, path)
    resumed = _steps(rank, fresh, opt_fresh, range(SAVED_AT, RESUMED_UNTIL))
    pairs = [(a, b) for run, again in zip(uninterrupted, resumed) for a, b in zip(run, again)]
    other = opt.state_dict()  # this rank's part, loaded as if there were twice as many ranks
    other["fsdp_ranks"] = {**other["fsdp_ranks"], "world_size": 2 * rank.world}
    with pytest.raises(ValueError, match="as many FSDP2 ranks as saved it") as refused:
        opt_fresh.load_state_dict(other)
    return {
        "deviation": max(_deviation(a, b) for a, b in pairs),
        "bitwise": all(torch.equal(a, b) for a, b in pairs),
        "steps": [s["step"] for s in opt_fresh.state_dict()["group_state"]],
        "other_world": str(refused.value),
    }


def _failure(rank: Rank) -> dict:
    """A singular factor without damping under FSDP2: its owner's inversion fails, and every
    rank raises ``LinAlgError`` with nothing changed; a damped step on the same ranks follows."""
    model = curvopt.extend(build("mlp"))
    shard(model, "mlp")
    before = [p.full_tensor().clone() for p in model.parameters()]
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    first, *rest = model.parameters()  # the first layer's weight alone undamped
    groups = [{"params": [first], "damping": 0.0}, {"params": rest}]
    opt = KFAC(groups, lr=0.3, damping=1e-2, curvature="kflr")
    X, y = global_batch("mlp")
    X = X.clone()
    X[:, 0] = 0  # the input factor of the first layer is singular: no inverse without damping
    X_mine, y_mine = rank.mine(X, y)
    with opt.collect():
        lossfunc(model(X_mine), y_mine).backward()
    with pytest.raises(torch.linalg.LinAlgError) as error:
        opt.step()
    unchanged = all(torch.equal(b, p.full_tensor()) for b, p in zip(before, model.parameters()))
    opt.param_groups[0]["damping"] = 1e-2
    opt.zero_grad()
    with opt.collect():
        lossfunc(model(X_mine), y_mine).backward()
    opt.step()
    moved = not any(torch.equal(b, p.full_tensor()) for b, p in zip(before, model.parameters()))
    owners = owners_of(list(model.parameters()), rank.world)
    return {"message": str(error.value), "unchanged": unchanged, "moved": moved, "owner": owners[0]}


#: ``VarianceAdaptedSGD``'s cases: the model, and the largest norm ``clip_grad_norm_`` leaves
#: (None: no clipping; 0.05 clips every step here)
VARIANCE_CASES = {"mlp": None, "cnn": None, "gpt": None, "mlp_clipped": 0.05}


def _variance_adapted(rank: Rank, case: str) -> dict:
    """``VarianceAdaptedSGD`` (momentum, weight decay) under FSDP2, two steps, against one
    process on the concatenated batch: each rank steps its rows with its rows of the averaged
    ``Σ g²`` and of FSDP2's gradient. With ``clip_grad_norm_`` on the sharded gradients (a
    rescaling it recognises) and on the reference's."""
    name, clip = case.split("_")[0], VARIANCE_CASES[case]
    reference, model = build(name), build(name)
    curvopt.extend(model)
    shard(model, name)
    curvopt.extend(reference)
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    options = {"lr": 0.2, "momentum": 0.5, "weight_decay": 1e-3}
    opt = VarianceAdaptedSGD(model.parameters(), **options)
    opt_reference = VarianceAdaptedSGD(reference.parameters(), **options, process_group=False)
    X, y = global_batch(name)
    X_mine, y_mine = rank.mine(X, y)
    norms = []
    for _ in range(2):
        for net, o, inputs, targets in (
            (model, opt, X_mine, y_mine),
            (reference, opt_reference, X, y),
        ):
            o.zero_grad()
            with o.collect():
                lossfunc(net(inputs), targets).backward()
            if clip is not None:
                norms.append(float(nn.utils.clip_grad_norm_(net.parameters(), clip)))
            o.step()
    params = list(model.parameters())
    shapes = [list(opt.state[p]["exp_avg"].shape) == list(p.to_local().shape) for p in params]
    return {
        "deviation": max(
            float((p.full_tensor() - q).detach().abs().max())
            for p, q in zip(params, reference.parameters())
        ),
        "rows_of_momentum": all(shapes),
        "clipped": min(norms) > clip if clip is not None else None,
    }


def scenarios(rank: Rank) -> dict:
    out = {
        "two_dimensional_mesh": _two_dimensional_mesh(rank),
        **{f"variance_{c}": _variance_adapted(rank, c) for c in VARIANCE_CASES},
    }
    out["failure"] = _failure(rank)
    for order in ("before", "after"):
        out[f"quantities_{order}"] = _quantities(rank, order)
    out["tied_reductions"] = _tied_reductions(rank)
    for optimizer in RESUMED if rank.world == 2 else ():  # (the steps: the 2 ranks' check)
        out[f"resumed_{optimizer}"] = _resumed(rank, optimizer)
    for name in ("mlp", "cnn", "gpt"):
        for optimizer in OPTIMIZERS:
            try:
                out[f"{optimizer}_{name}"] = _optimizer(rank, name, optimizer)
            except Exception:  # noqa: BLE001 (reported by the test that reads it)
                out[f"{optimizer}_{name}"] = traceback.format_exc()
            gc.collect()
    return out


# ----------------------------------------------------------------------------- spawning
def _worker(rank, world, outdir):
    torch.set_num_threads(1)
    run_rank(rank, world, outdir, lambda r, k: scenarios(Rank(r, k, outdir)))


@pytest.fixture(scope="module", params=[2, 4], ids=lambda k: f"{k}ranks")
def ranks(request, tmp_path_factory):
    world = request.param
    return spawn_ranks(world, str(tmp_path_factory.mktemp(f"fsdp{world}")), _worker)


# ----------------------------------------------------------------------------- tests
TOL = 1e-12


@pytest.mark.parametrize("order", ["before", "after"])
def test_first_order_quantities_are_the_ranks_samples_whole_on_the_sharded_parameter(ranks, order):
    """``extend`` before or after ``fully_shard``: each rank's ``grad_batch``, ``batch_l2``,
    ``sum_grad_squared`` and ``variance`` are those of its samples (one process, a per-sample
    loop), whole, on the sharded ``DTensor`` parameters; none is left on FSDP2's gathered
    ones; ``local_rows`` of the ranks' average is FSDP2's own gradient shard."""
    for result in ranks:
        found = result[f"quantities_{order}"]
        assert set(found["types"]) == {"DTensor"}
        for what in (*FIRST_ORDER, "loop", "local_rows"):
            assert found[what] <= TOL, (what, found[what])
        assert found["gathered"] == 4 and found["left_on_gathered"] == 0
        assert "Pass the parameter's own quantity" in found["bad_rows"]


def test_a_tied_weights_reduced_quantities_sum_its_uses_under_fsdp2(ranks):
    """The GPT's tied embedding/head: ``batch_l2``, ``sum_grad_squared`` and ``variance`` of
    the rank's samples equal one process's (FSDP2's gathered parameter is put on both modules;
    each use alone would be squared apart)."""
    for result in ranks:
        found = result["tied_reductions"]
        assert max(found.values()) <= TOL, found


@pytest.mark.parametrize("optimizer", sorted(RESUMED))
def test_a_run_resumed_from_a_dcp_checkpoint_takes_the_same_steps_bit_for_bit(ranks, optimizer):
    """Saved after step 15 with ``torch.distributed.checkpoint`` (the recipe of
    docs/distributed.md#fsdp2), loaded into a fresh model and optimizer: steps 16 to 22 (the
    inverses' refresh at step 20 included) equal the uninterrupted run's bit for bit."""
    if f"resumed_{optimizer}" not in ranks[0]:
        pytest.skip("the resumed runs are checked with 2 ranks")
    for rank, result in enumerate(ranks):
        found = result[f"resumed_{optimizer}"]
        assert found["bitwise"] and found["deviation"] == 0.0, found
        assert found["steps"] == [RESUMED_UNTIL], found
        # each rank's part of the state: loaded with as many ranks as saved it, else refused
        assert f"rank {rank} of {2 * len(ranks)} under FSDP2" in found["other_world"], found


def test_a_two_dimensional_mesh_raises_naming_the_fix_and_changes_nothing(ranks):
    for result in ranks:
        message = result["two_dimensional_mesh"]
        assert "one-dimensional mesh" in message and "Apply fully_shard over one" in message
        assert "(parameters changed)" not in message


def test_a_failed_inversion_on_its_owner_raises_on_every_rank_and_changes_nothing(ranks):
    """The first layer's singular factor fails on its owner only; every rank raises
    ``LinAlgError`` (the owner its own, naming the parameter; the others naming the owner),
    nothing is changed, and a damped step on the same ranks then moves every parameter."""
    for rank, result in enumerate(ranks):
        found = result["failure"]
        if rank == found["owner"]:
            assert "parameter #0" in found["message"], found
        else:
            assert f"failed on rank {found['owner']}" in found["message"], found
        assert found["unchanged"] and found["moved"], found


@pytest.mark.parametrize("case", sorted(VARIANCE_CASES))
def test_variance_adapted_sgd_under_fsdp2_equals_one_process(ranks, case):
    """``VarianceAdaptedSGD`` (momentum, weight decay), two steps, every rank its rows: equal
    to one process on the concatenated batch to 1e-12 (MLP, CNN, the tied GPT; with
    ``clip_grad_norm_`` clipping the sharded gradients at every step), ``exp_avg`` kept as
    the rank's rows."""
    for result in ranks:
        found = result[f"variance_{case}"]
        assert found["deviation"] <= TOL, found
        assert found["rows_of_momentum"], found
        assert found["clipped"] in (None, True), found


@pytest.mark.parametrize("name", ["mlp", "cnn"])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_steps_under_fsdp2_equal_one_process_on_the_concatenated_batch(ranks, optimizer, name):
    """Two steps (EKFAC three, ``EKFAC_STEPS``; momentum, weight decay, the trust region;
    KFLR's factors are averaged over the ranks: the full batch's, exactly, with equal shards)
    leave every parameter as one process on the concatenated batch would, on every rank."""
    for result in ranks:
        found = result[f"{optimizer}_{name}"]
        assert isinstance(found, dict), found
        found = dict(found)  # (its state layout is read by another test)
        found.pop("tied_step"), found.pop("state")
        assert max(found.values()) <= TOL, found


#: the optimizers whose state each layer's owner keeps alone (EKFAC's bases: on every rank)
OWNED = ("diag_ggn", "kfac", "kfac_exact_damping")


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt"])
@pytest.mark.parametrize("optimizer", OWNED)
def test_each_rank_keeps_only_its_own_layers_curvature_under_fsdp2(ranks, optimizer, name):
    """After the steps above (equal to one process): each parameter's curvature, its inverses
    and derived entries are in the state of exactly its owner (``owners_of``, balanced by
    ``Σ dim³``); every other rank keeps only the owner's number and its rows of momentum
    (shaped as its shard). So the ranks' state adds up to one process's, and each rank holds
    less than one process."""
    world = len(ranks)
    for rank, result in enumerate(ranks):
        layout = result[f"{optimizer}_{name}"]["state"]
        for owner, keys, momentum, shard_shape in zip(
            layout["owners"], layout["keys"], layout["momentum"], layout["shard"]
        ):
            if owner == rank:
                assert "curvature" in keys and "curvature_owner" not in keys, keys
            else:
                assert set(keys) <= {"curvature_owner", "momentum"}, keys
            if "momentum" in keys:
                assert momentum == shard_shape, (momentum, shard_shape)
        assert len(set(layout["owners"])) == min(world, len(layout["owners"]))
        assert layout["bytes_all_ranks"] == layout["one_process"], layout
        assert layout["bytes"] < layout["one_process"], layout


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_gpt_with_a_tied_head_under_fsdp2(ranks, optimizer):
    """A two-block GPT, its head tied to the token embedding: one step equals one process to
    1e-12 for every parameter (EKFAC's second, in the bases of the averaged factors, to
    ``EIGENBASIS_TOL``), the tied one included (its uses' factors are all-reduced
    before the nearest Kronecker product is formed, as under DDP)."""
    tolerance = EIGENBASIS_TOL if optimizer.startswith("ekfac") else TOL
    for result in ranks:
        found = result[f"{optimizer}_gpt"]
        assert isinstance(found, dict), found
        found = dict(found)  # (its state layout is read by another test)
        step, _ = found.pop("tied_step"), found.pop("state")
        assert step > 1e-6, step  # the tied weight moved
        assert found.pop("first_step") <= TOL, found
        assert max(found.values()) <= tolerance, found


ROOT = Path(__file__).resolve().parents[1]


def _example():
    spec = importlib.util.spec_from_file_location(
        "_example_fsdp_kfac", ROOT / "examples" / "fsdp_kfac.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_example_runs_under_torchrun_as_one_process_would():
    """``torchrun --nproc_per_node 2 examples/fsdp_kfac.py``: the global batch's losses it
    prints are those of one process stepping KFAC on the unsharded model."""
    steps = 6
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
    ]
    done = subprocess.run(
        [*command, str(ROOT / "examples" / "fsdp_kfac.py"), "--steps", str(steps)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    printed = {int(k): float(v) for k, v in re.findall(r"step +(\d+) +loss ([\d.]+)", done.stdout)}
    assert sorted(printed) == [0, 5] and "rank 1: parameter shard" in done.stdout
    example = _example()
    model, lossfunc = curvopt.extend(example.make_model()), curvopt.extend(nn.CrossEntropyLoss())
    opt = KFAC(model.parameters(), **example.OPTIONS, process_group=False)
    for step in range(steps):
        X, y = example.global_batch(step)
        opt.zero_grad()
        with opt.collect():
            loss = lossfunc(model(X), y)
            loss.backward()
        opt.step()
        if step in printed:
            assert abs(float(loss) - printed[step]) <= 1e-4, (step, float(loss), printed[step])
