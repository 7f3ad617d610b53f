"""Curvature optimizers over ``torch.distributed`` (``curvopt.optim.distributed``).

The multi-rank checks spawn 2 and 3 gloo ranks once per world size (start-up, mostly importing
torch, dominates); every rank runs all scenarios below on a ``DistributedDataParallel`` model in
float64 with its shard of each batch, computes the single-process reference itself, and writes its
measurements to a JSON file that the tests read.

The ranks are spawned by ``distributed_harness`` (a ``FileStore`` instead of a TCP port, long
timeouts, and a teardown that cannot abort: see there).
"""

from __future__ import annotations

import copy
import os
import pickle

import pytest
import torch
import torch.distributed as dist
from torch import nn

import curvopt
from curvopt import extensions as ext
from curvopt.optim import EKFAC, KFAC, DiagGGNNewton, LevenbergMarquardt, VarianceAdaptedSGD
from curvopt.optim.distributed import (
    DistributedCurvature,
    assign_owners,
    draw_seed,
    inversion_cost,
    rank_rng,
    resolve,
)
from distributed_harness import join, run_rank, spawn_ranks
from fixtures import zoo

DT = torch.float64
N = 12  # batch size: shards of 6 (2 ranks) and 4 (3 ranks)
STEPS = 4
VOCAB = 7


# ----------------------------------------------------------------------------- in-process
def test_assign_owners_is_greedy_longest_processing_time():
    assert assign_owners([341, 216, 243, 27], 2) == [0, 1, 1, 0]
    assert assign_owners([341, 216, 243, 27], 3) == [0, 2, 1, 2]
    assert assign_owners([1.0, 1.0, 1.0], 2) == [0, 1, 0]  # ties: lower index, lower rank
    assert assign_owners([], 4) == []
    costs = [
        float(c) for c in torch.randint(1, 1000, (40,), generator=torch.Generator().manual_seed(0))
    ]
    owners = assign_owners(costs, 4)
    loads = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(4)]
    assert max(loads) <= sum(costs) / 4 + max(costs)  # the LPT bound


def test_inversion_cost_is_sum_of_cubed_factor_sizes():
    assert inversion_cost([torch.zeros(3, 3), torch.zeros(5, 5)]) == 27 + 125
    assert inversion_cost([torch.zeros(4, 4)]) == 64
    assert inversion_cost(torch.zeros(2, 3)) == 6


def test_rank_rng_gives_independent_streams_and_restores_the_global_one():
    torch.manual_seed(0)
    seed = draw_seed()
    after_draw = torch.get_rng_state()
    draws = []
    for rank in range(3):
        with rank_rng(seed, rank):
            draws.append(torch.rand(4))
        assert torch.equal(torch.get_rng_state(), after_draw)
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[1], draws[2])
    with rank_rng(seed, 1):
        assert torch.equal(torch.rand(4), draws[1])


def test_without_torch_distributed_nothing_changes():
    assert not dist.is_initialized()
    assert resolve(None, True, "KFAC") is None
    assert resolve(False, True, "KFAC") is None
    model = nn.Linear(2, 2)
    assert KFAC(model.parameters(), lr=0.1, damping=1e-3)._distributed is None
    assert VarianceAdaptedSGD(model.parameters(), lr=0.1)._distributed is None
    with pytest.raises(RuntimeError, match="init_process_group"):
        DistributedCurvature()


def test_explicit_group_of_one_rank_matches_a_single_process(tmp_path):
    """A one-rank group: averaging and spreading are identities, the trajectory is unchanged."""
    join(0, 1, str(tmp_path))
    try:
        assert resolve(None, True, "KFAC") is None  # automatic: one rank is no distribution
        group = DistributedCurvature(bucket_cap_mb=1e-4)  # tiny buckets: one tensor each
        results = []
        for process_group in (False, group):
            model, lossfunc = mlp(), curvopt.extend(nn.CrossEntropyLoss())
            opt = KFAC(
                model.parameters(),
                lr=0.3,
                damping=1e-2,
                curvature="kflr",
                process_group=process_group,
            )
            for X, y in batches(3):
                opt.zero_grad()
                with opt.collect():
                    lossfunc(model(X), y).backward()
                opt.step()
            results.append(flat(model))
        # equal up to round-off: broadcast inverses are contiguous copies (layouts may differ)
        torch.testing.assert_close(results[0], results[1], rtol=0, atol=1e-12)
        assert group.stats.allreduce_calls == 3 * 6  # 6 factors ([B, A] per weight, [B] per bias)
        assert group.stats.inversions == 3 * 4 and group.stats.received == 0
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- models, data
def mlp(seed=0):
    torch.manual_seed(seed)
    return curvopt.extend(nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).to(DT))


def cnn(seed=0):
    torch.manual_seed(seed)
    return curvopt.extend(
        nn.Sequential(
            nn.Conv2d(2, 3, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(3 * 3 * 3, 4),
        ).to(DT)
    )


def grouped_cnn(seed=0):
    torch.manual_seed(seed)
    return curvopt.extend(
        nn.Sequential(
            nn.Conv2d(2, 4, 3, padding=1, groups=2),
            nn.Tanh(),
            nn.Conv2d(4, 4, 3, padding=1, groups=4),
            nn.Tanh(),
            nn.Flatten(),
            nn.Linear(4 * 6 * 6, 4),
        ).to(DT)
    )


def tiny_gpt(seed=0):
    """A GPT-style decoder whose output layer's weight *is* the token embedding's."""
    torch.manual_seed(seed)
    return curvopt.extend(zoo.GPT(vocab=VOCAB, t_max=4).to(DT))


def token_batches(steps, seed=1):
    """Sequences of 4 tokens and their next tokens (every position counted: equal shards
    of the loss's divisor)."""
    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, VOCAB, (N, 5), generator=g) for _ in range(steps)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def batches(steps, image=False, seed=1):
    g = torch.Generator().manual_seed(seed)
    shape = (N, 2, 6, 6) if image else (N, 5)
    classes = 4 if image else 3
    return [
        (torch.randn(*shape, generator=g, dtype=DT), torch.randint(0, classes, (N,), generator=g))
        for _ in range(steps)
    ]


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# ----------------------------------------------------------------------------- rank side
class Rank:
    def __init__(self, rank, world):
        self.rank, self.world = rank, world

    def shard(self, X, y):
        n = X.shape[0] // self.world
        return X[self.rank * n : (self.rank + 1) * n], y[self.rank * n : (self.rank + 1) * n]

    def spread(self, model) -> float:
        """max |θ_rank − θ_rank0| over all ranks (0.0: bit-identical replicas)."""
        mine = flat(model)
        every = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(every, mine)
        return max(float((t - every[0]).abs().max()) for t in every)

    def train(
        self,
        make_model,
        make_opt,
        data,
        reduction="mean",
        collect=None,
        closure=False,
        flat=False,
        before_step=None,
    ):
        """DDP training on this rank's shards; returns the inner model and the optimizer.
        ``flat``: the model's outputs and targets have a sequence dim, flattened for the loss;
        ``before_step(model)`` runs between the backward pass and the step."""
        model = make_model()
        ddp = nn.parallel.DistributedDataParallel(model)
        lossfunc = _loss(reduction, flat)
        opt = make_opt(model.parameters())
        for X, y in data:
            Xs, ys = self.shard(X, y)
            if closure:

                def step_closure(Xs=Xs, ys=ys):
                    opt.zero_grad()
                    loss = lossfunc(ddp(Xs), ys)
                    loss.backward()
                    return loss

                opt.step(step_closure)
                continue
            opt.zero_grad()
            loss = lossfunc(ddp(Xs), ys)
            with collect() if collect else opt.collect():
                loss.backward()
            if before_step is not None:
                before_step(model)
            opt.step()
        return model, opt


def _loss(reduction="mean", flat=False):
    """The extended cross-entropy as a function of the outputs and targets (``flat``: of
    ``[n, T, V]`` logits and ``[n, T]`` tokens, flattened)."""
    lossfunc = curvopt.extend(nn.CrossEntropyLoss(reduction=reduction))
    if not flat:
        return lossfunc
    return lambda out, y: lossfunc(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def reference(
    make_model,
    make_opt,
    data,
    reduction="mean",
    world=1,
    closure=False,
    flat=False,
    before_step=None,
):
    """One process on the full batches. DDP's objective is the ranks' mean loss: with
    ``reduction="sum"`` that is the full-batch sum divided by the number of ranks."""
    model = make_model()
    lossfunc = _loss(reduction, flat)
    opt = make_opt(model.parameters(), process_group=False)
    scale = 1.0 / world if reduction == "sum" else 1.0
    for X, y in data:
        if closure:

            def step_closure(X=X, y=y):
                opt.zero_grad()
                loss = lossfunc(model(X), y) * scale
                loss.backward()
                return loss

            opt.step(step_closure)
            continue
        opt.zero_grad()
        loss = lossfunc(model(X), y) * scale
        with opt.collect():
            loss.backward()
        if before_step is not None:
            before_step(model)
        opt.step()
    return model, opt


def simulated(make_model, make_opt, data, world, attr):
    """One process emulating ``world`` ranks: shard curvature and gradients computed with the
    ranks' random streams, averaged, then one ordinary step (for Monte-Carlo curvature)."""
    model = make_model()
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    opt = make_opt(model.parameters(), process_group=False)
    params = list(model.parameters())
    for X, y in data:
        seed = draw_seed()
        grads, curv = [], []
        for r in range(world):
            n = X.shape[0] // world
            Xs, ys = X[r * n : (r + 1) * n], y[r * n : (r + 1) * n]
            opt.zero_grad()
            with rank_rng(seed, r), opt.collect():
                lossfunc(model(Xs), ys).backward()
            grads.append([p.grad.clone() for p in params])
            curv.append([getattr(p, attr) for p in params])
        for i, p in enumerate(params):
            p.grad = sum(g[i] for g in grads) / world
            c = [c[i] for c in curv]
            if isinstance(c[0], torch.Tensor):
                setattr(p, attr, sum(c) / world)
            else:
                setattr(p, attr, [sum(f) / world for f in zip(*c)])
        opt.step()
    return model


def _diff(a, b) -> float:
    return float((flat(a) - flat(b)).abs().max())


def scenarios(R: Rank) -> dict:
    out = {}
    data, images = batches(STEPS), batches(STEPS, image=True)

    # --- exact diagonal GGN: equal to one process on the full batch (mean and sum losses)
    for reduction in ("mean", "sum"):

        def make(params, **kw):
            return DiagGGNNewton(
                params,
                lr=0.5,
                damping=1e-2,
                curvature="exact",
                weight_decay=1e-3,
                momentum=0.5,
                **kw,
            )

        model, opt = R.train(mlp, make, data, reduction)
        ref, _ = reference(mlp, make, data, reduction, R.world)
        out[f"diag_exact_{reduction}"] = {
            "vs_single": _diff(model, ref),
            "spread": R.spread(model),
            "moved": _diff(model, mlp()),
            "allreduce_calls": opt._distributed.stats.allreduce_calls,
        }

    # --- KFLR, trace-norm damping, MLP: equal to one process on the full batch
    def make_kflr(params, **kw):
        return KFAC(
            params, lr=0.3, damping=1e-2, curvature="kflr", weight_decay=1e-3, momentum=0.3, **kw
        )

    model, opt = R.train(mlp, make_kflr, data)
    ref, _ = reference(mlp, make_kflr, data)
    stats = opt._distributed.stats
    out["kflr_trace_norm"] = {
        "vs_single": _diff(model, ref),
        "spread": R.spread(model),
        "moved": _diff(model, mlp()),
        "inversions": stats.inversions,
        "received": stats.received,
    }

    # --- KFLR, exact damping (eigendecompositions), CNN, intervals and EMA
    def make_cnn(params, **kw):
        return KFAC(
            params,
            lr=0.2,
            damping=1e-2,
            curvature="kflr",
            kronecker_damping="exact",
            curvature_interval=2,
            curvature_ema=0.5,
            **kw,
        )

    model, opt = R.train(cnn, make_cnn, images)
    ref, _ = reference(cnn, make_cnn, images)
    out["kflr_exact_cnn"] = {
        "vs_single": _diff(model, ref),
        "spread": R.spread(model),
        "moved": _diff(model, cnn()),
        "allreduce_calls": opt._distributed.stats.allreduce_calls,
    }

    # --- a grouped (depthwise) CNN: per-group factors [G, d, d] averaged, their inverses spread
    def make_grouped(params, **kw):
        return KFAC(params, lr=0.2, damping=1e-2, curvature="kflr", kronecker_damping=kind, **kw)

    for kind in ("trace_norm", "trace_norm_eigh"):
        model, _ = R.train(grouped_cnn, make_grouped, images)
        ref, _ = reference(grouped_cnn, make_grouped, images)
        out[f"kflr_grouped_cnn_{kind}"] = {
            "vs_single": _diff(model, ref),
            "spread": R.spread(model),
            "moved": _diff(model, grouped_cnn()),
        }

    # --- the backward pass in curvopt.collect(...) instead of opt.collect(): still averaged
    model, _ = R.train(mlp, make_kflr, data, collect=lambda: curvopt.collect(ext.KFLR()))
    ref, _ = reference(mlp, make_kflr, data)
    out["plain_collect"] = {"vs_single": _diff(model, ref), "spread": R.spread(model)}

    # --- Levenberg-Marquardt damping with a closure: the mean loss change drives it
    def make_lm(params, **kw):
        return KFAC(
            params,
            lr=0.5,
            curvature="kflr",
            damping=LevenbergMarquardt(1e-1, interval=1, omega=2.0),
            **kw,
        )

    model, opt = R.train(mlp, make_lm, data, closure=True)
    ref, ref_opt = reference(mlp, make_lm, data, closure=True)
    out["levenberg_marquardt"] = {
        "vs_single": _diff(model, ref),
        "spread": R.spread(model),
        "damping": opt.damping(),
        "damping_single": ref_opt.damping(),
    }

    # --- EKFAC: S averaged in the bases every rank shares, factors averaged for the next
    # bases, their eigendecompositions spread; basis_interval=2 refreshes at steps 0 and 2
    def make_ekfac(params, **kw):
        return EKFAC(
            params,
            lr=0.2,
            damping=1e-2,
            curvature="kflr",
            basis_interval=2,
            weight_decay=1e-3,
            momentum=0.3,
            **kw,
        )

    cases = [(f"ekfac_mlp_{r}", mlp, data, r, {}) for r in ("mean", "sum")]
    cases += [(f"ekfac_cnn_{r}", cnn, images, r, {}) for r in ("mean", "sum")]
    cases.append(("ekfac_mlp_one_sided", mlp, data, "mean", {"max_basis_dim": 5}))
    # the trust region in the averaged factors' eigenvalues, whole on every rank
    cases.append(("ekfac_mlp_ggn", mlp, data, "mean", {"trust_metric": "ggn"}))
    # warm refreshes: the trust region's K kept from the basis step, formed after the spread
    cases.append(("ekfac_mlp_kept", mlp, data, "mean", {"basis_refresh": "warm"}))
    for name, make_model, inputs, reduction, options in cases:

        def make(params, options=options, **kw):
            return make_ekfac(params, **options, **kw)

        model, opt = R.train(make_model, make, inputs, reduction)
        ref, _ = reference(make_model, make, inputs, reduction, R.world)
        out[name] = {
            "vs_single": _diff(model, ref),
            "spread": R.spread(model),
            "moved": _diff(model, make_model()),
            "decompositions": opt._distributed.stats.inversions,
            "received": opt._distributed.stats.received,
        }
    try:
        R.train(mlp, lambda params: make_ekfac(params, basis_source="current"), data)
        out["ekfac_current_refused"] = ""
    except NotImplementedError as error:
        out["ekfac_current_refused"] = str(error)

    # --- a tied embedding/head: each use's factors averaged, their nearest product made after
    tokens = token_batches(STEPS)

    def make_tied(params, **kw):
        return KFAC(params, lr=0.1, damping=1e-2, curvature="kflr", **kw)

    model, opt = R.train(tiny_gpt, make_tied, tokens, flat=True)
    ref, _ = reference(tiny_gpt, make_tied, tokens, flat=True)
    out["tied_gpt"] = {
        "vs_single": _diff(model, ref),
        "spread": R.spread(model),
        "moved": _diff(model, tiny_gpt()),
        "tied": model.head.weight is model.tok.weight,
    }

    # --- Monte-Carlo curvature: independent per-rank samples, identical replicas
    for name, make, attr in (
        (
            "diag_mc",
            lambda params, **kw: DiagGGNNewton(params, lr=0.5, damping=1e-2, **kw),
            "diag_ggn_mc",
        ),
        (
            "kfac_mc",
            lambda params, **kw: KFAC(params, lr=0.3, damping=1e-2, mc_samples=2, **kw),
            "kfac",
        ),
    ):
        torch.manual_seed(123)
        model, opt = R.train(mlp, make, data)
        torch.manual_seed(123)
        sim = simulated(mlp, make, data, R.world, attr)
        # the same batch on every rank: the raw (not yet averaged) samples still differ
        same = mlp()
        ddp = nn.parallel.DistributedDataParallel(same)
        opt2 = make(same.parameters())
        X, y = data[0]
        with opt2.collect():
            curvopt.extend(nn.CrossEntropyLoss())(ddp(X), y).backward()
        raw = torch.cat([t.reshape(-1) for t in _raw(same.parameters(), attr)])
        every = [torch.empty_like(raw) for _ in range(R.world)]
        dist.all_gather(every, raw)
        opt2.step()
        out[name] = {
            "vs_simulated": _diff(model, sim),
            "spread": R.spread(model),
            "raw_rank_difference": min(
                float((every[r] - every[0]).abs().max()) for r in range(1, R.world)
            ),
        }

    # --- failures are raised on every rank and change nothing
    before = mlp()
    model, lossfunc = mlp(), curvopt.extend(nn.CrossEntropyLoss())
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = KFAC(model.parameters(), lr=0.3, damping=0.0, curvature="kflr")
    X, y = data[0]
    X = X.clone()
    X[:, 0] = 0  # the input factor of the first layer is singular: no inverse without damping
    errors = []
    Xs, ys = R.shard(X, y)
    opt.zero_grad()
    with opt.collect():
        lossfunc(ddp(Xs), ys).backward()
    try:
        opt.step()
    except torch.linalg.LinAlgError as error:
        errors.append(str(error))
    unchanged = _diff(model, before)
    opt.param_groups[0]["damping"] = 1e-2  # then a healthy step on the same ranks
    opt.zero_grad()
    with opt.collect():
        lossfunc(ddp(Xs), ys).backward()
    opt.step()
    out["errors"] = {
        "linalg_raised": len(errors),
        "message": errors[0] if errors else "",
        "unchanged": unchanged,
        "steps": opt._group_state[0]["step"],
        "spread_after": R.spread(model),
    }

    # --- explicit process group; False keeps each rank's own curvature
    group = dist.new_group(list(range(R.world)))
    model, opt = R.train(mlp, lambda p: make_kflr(p, process_group=group), data)
    ref, _ = reference(mlp, make_kflr, data)
    local, _ = R.train(mlp, lambda p: make_kflr(p, process_group=False), data)
    out["process_group"] = {
        "vs_single": _diff(model, ref),
        "spread": R.spread(model),
        "uses_group": opt._distributed.group is group,
        "local_spread": R.spread(local),
    }

    # --- copies stay distributed; a non-default group cannot be pickled
    opt = make_kflr(mlp().parameters())
    copied, loaded = copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))
    try:
        pickle.dumps(make_kflr(mlp().parameters(), process_group=group))
        refused = False
    except TypeError:
        refused = True
    out["copies"] = {
        "deepcopy": isinstance(copied._distributed, DistributedCurvature)
        and copied._distributed is not opt._distributed,
        "pickle": isinstance(loaded._distributed, DistributedCurvature),
        "group_pickle_refused": refused,
    }

    # --- VarianceAdaptedSGD: Σ g² averaged, the variance that of all ranks' samples
    for reduction in ("mean", "sum"):

        def make_svag(params, **kw):
            return VarianceAdaptedSGD(params, lr=0.5, momentum=0.5, weight_decay=1e-3, **kw)

        model, _ = R.train(mlp, make_svag, data, reduction)
        ref, _ = reference(mlp, make_svag, data, reduction, R.world)
        out[f"svag_{reduction}"] = {
            "vs_single": _diff(model, ref),
            "spread": R.spread(model),
            "moved": _diff(model, mlp()),
        }

    # ... with the gradient rescaled before the step (clip_grad_norm_: its variance scales)
    def clip(model):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)

    def make_svag(params, **kw):
        return VarianceAdaptedSGD(params, lr=0.5, **kw)

    model, _ = R.train(mlp, make_svag, data, before_step=clip)
    ref, _ = reference(mlp, make_svag, data, before_step=clip)
    out["svag_clipped"] = {
        "vs_single": _diff(model, ref),
        "spread": R.spread(model),
        "moved": _diff(model, mlp()),
    }
    try:  # ... or changed otherwise: its variance is unknown, on every rank
        R.train(
            mlp,
            make_svag,
            data,
            before_step=lambda m: nn.utils.clip_grad_value_(m.parameters(), 1e-3),
        )
        out["svag_clip_value_refused"] = ""
    except RuntimeError as error:
        out["svag_clip_value_refused"] = str(error)
    return out


def _raw(params, attr):
    for p in params:
        value = getattr(p, attr)
        yield from ([value] if isinstance(value, torch.Tensor) else value)


def _worker(rank, world, outdir):
    torch.set_num_threads(1)
    run_rank(rank, world, outdir, lambda rank, world: scenarios(Rank(rank, world)))


@pytest.fixture(scope="module", params=[2, 3], ids=lambda k: f"{k}ranks")
def ranks(request, tmp_path_factory):
    world = request.param
    return spawn_ranks(world, str(tmp_path_factory.mktemp(f"dist{world}")), _worker)


def _aborting_worker(rank, world, outdir):
    """Rank 1 dies of SIGABRT (as gloo's C++ aborts) while rank 0 waits for it."""
    join(rank, world, outdir)
    if rank == 1:
        os.abort()
    dist.barrier()


def test_a_rank_killed_by_a_signal_fails_naming_every_rank_and_its_stack(tmp_path):
    with pytest.raises(AssertionError) as failure:
        spawn_ranks(2, str(tmp_path), _aborting_worker)
    message = str(failure.value)
    assert "SIGABRT" in message and "rank 0: killed before writing a result" in message
    assert "rank 1: killed before writing a result" in message and "_aborting_worker" in message


TOL = 1e-6
#: EKFAC and tied weights: one process up to round-off
EXACT = 1e-12


@pytest.mark.parametrize(
    "name",
    [
        "diag_exact_mean",
        "diag_exact_sum",
        "kflr_trace_norm",
        "kflr_exact_cnn",
        "kflr_grouped_cnn_trace_norm",
        "kflr_grouped_cnn_trace_norm_eigh",
        "plain_collect",
        "process_group",
    ],
)
def test_deterministic_curvature_equals_one_process_on_the_full_batch(ranks, name):
    for result in ranks:
        r = result[name]
        assert r["vs_single"] < TOL, r
        assert r["spread"] == 0.0, r  # bit-identical replicas
        assert r.get("moved", 1.0) > 1e-3, r  # the steps did something


def test_curvature_is_bucketed_and_only_collected_when_due(ranks):
    for result in ranks:
        assert result["diag_exact_mean"]["allreduce_calls"] == STEPS  # 4 tensors, one bucket
        assert result["kflr_exact_cnn"]["allreduce_calls"] == STEPS // 2  # curvature_interval=2


def test_inversions_are_spread_over_the_ranks(ranks):
    world = len(ranks)
    per_rank = [r["kflr_trace_norm"]["inversions"] for r in ranks]
    assert sum(per_rank) == 4 * STEPS  # each of 4 parameters' inverse once per step
    assert all(n > 0 for n in per_rank)  # every rank computed some
    for r in ranks:
        assert r["kflr_trace_norm"]["inversions"] + r["kflr_trace_norm"]["received"] == 4 * STEPS
    assert world == len(per_rank)


def test_levenberg_marquardt_uses_the_mean_loss_change(ranks):
    for result in ranks:
        r = result["levenberg_marquardt"]
        assert r["vs_single"] < TOL and r["spread"] == 0.0, r
        assert r["damping"] == pytest.approx(r["damping_single"], rel=1e-12), r
        assert r["damping"] != 1e-1, r  # it adapted


@pytest.mark.parametrize("name", ["diag_mc", "kfac_mc"])
def test_monte_carlo_curvature_is_independent_per_rank_and_identical_after(ranks, name):
    for result in ranks:
        r = result[name]
        assert r["spread"] == 0.0, r
        assert r["vs_simulated"] < TOL, r  # = one process averaging the ranks' samples
        assert r["raw_rank_difference"] > 0.0, r  # same data, different samples per rank


def test_failures_raise_on_every_rank_and_change_nothing(ranks):
    for result in ranks:
        r = result["errors"]
        assert r["linalg_raised"] == 1 and r["unchanged"] == 0.0, r
        assert "parameter #0" in r["message"], r
        assert r["steps"] == 1 and r["spread_after"] == 0.0, r  # only the healthy step counted


def test_process_group_argument(ranks):
    for result in ranks:
        assert all(result["copies"].values()), result["copies"]
        assert result["process_group"]["uses_group"]
        assert result["process_group"]["local_spread"] > 0.0  # rank-local curvature diverges


@pytest.mark.parametrize(
    "name",
    [
        "ekfac_mlp_mean",
        "ekfac_mlp_sum",
        "ekfac_cnn_mean",
        "ekfac_cnn_sum",
        "ekfac_mlp_one_sided",
        "ekfac_mlp_ggn",
        "ekfac_mlp_kept",
        "tied_gpt",
        "svag_mean",
        "svag_sum",
        "svag_clipped",
    ],
)
def test_ekfac_tied_weights_and_variance_equal_one_process(ranks, name):
    for result in ranks:
        r = result[name]
        assert r["vs_single"] < EXACT, r
        assert r["spread"] == 0.0, r  # bit-identical replicas
        assert r["moved"] > 1e-3, r
    assert ranks[0].get("tied_gpt", {}).get("tied", True)


def test_ekfac_eigendecompositions_are_spread_over_the_ranks(ranks):
    # two basis refreshes (steps 0 and 2) of the MLP's 4 parameters, each decomposed once
    per_rank = [r["ekfac_mlp_mean"]["decompositions"] for r in ranks]
    assert sum(per_rank) == 2 * 4 and all(n > 0 for n in per_rank), per_rank
    for r in ranks:
        assert r["ekfac_mlp_mean"]["decompositions"] + r["ekfac_mlp_mean"]["received"] == 2 * 4


def test_ekfac_current_basis_is_refused_under_ddp(ranks):
    for result in ranks:
        assert "basis_source='last_refresh'" in result["ekfac_current_refused"]


def test_variance_of_a_gradient_changed_otherwise_raises_on_every_rank(ranks):
    for result in ranks:
        assert "other than by a common factor" in result["svag_clip_value_refused"]
