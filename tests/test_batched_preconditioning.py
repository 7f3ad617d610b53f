"""Batched preconditioning (``curvopt.optim.plan``: ``buckets``, ``Stacks``): the blocks of
equal shapes are applied together, and the steps are those of the per-layer loop.

Each case trains a float64 model for several steps (a refresh, then plain steps, a refresh
again) with ``KFAC``, ``EKFAC`` and ``DiagGGNNewton``, and beside it the same optimizer whose
directions are the per-parameter loop of the unbatched path (``Loop*``: each parameter's
``DampedInverse.apply_one``); the parameters agree to 1e-12 at every step. A CPU step applies
its blocks one by one (``plan.batches_pay``: batches do not pay there), so the batched
optimizers here batch on the CPU too (``Batched*``), as they do on an accelerator. The cases hold
blocks of equal shapes (else nothing would be batched: checked), next to blocks alone in
their shapes, parameters without factors (the fallback) and biases.
"""

import copy

import pytest
import torch
from torch import nn

import curvopt
from curvopt.inversion.inverses import EigenCorrectedInverse
from curvopt.optim import EKFAC, KFAC, DiagGGNNewton
from curvopt.optim.plan import Stacks, batches_pay, buckets
from fixtures.zoo import Block

STEPS = 7
INTERVAL = 3


class BatchedKFAC(KFAC):
    """``KFAC`` batching on the CPU too."""

    def _batches(self, device):
        return True


class BatchedEKFAC(EKFAC):
    """``EKFAC`` batching on the CPU too."""

    def _batches(self, device):
        return True


class LoopKFAC(KFAC):
    """``KFAC`` with each direction by its own ``KroneckerInverse.apply_one``."""

    def _directions(self, items, step):
        solved = zip(self._inverses(items, step), items)
        return [(inverse.apply_one(item.grad), kept) for (inverse, kept), item in solved]


class LoopEKFAC(EKFAC):
    """``EKFAC`` with each direction by its own ``EigenCorrectedInverse.apply_one``."""

    def _directions(self, items, step):
        return [
            (EigenCorrectedInverse.build(item.curvature, step.damping).apply_one(item.grad), kept)
            for item, kept in zip(items, self._kept(items, step))
        ]


class LoopDiagGGNNewton(DiagGGNNewton):
    """``DiagGGNNewton`` with each direction by its own ``_direction``."""

    def _directions(self, items, step):
        return [self._direction(item, step) for item in items]


class Transformer(nn.Module):
    """Two pre-LayerNorm blocks of equal shapes between a linear embedding and a head."""

    def __init__(self, d=8):
        super().__init__()
        self.embed = nn.Linear(3, d)
        self.blocks = nn.ModuleList([Block(d, 2, causal=True) for _ in range(2)])
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return h[:, -1]


def _mlp():
    return nn.Sequential(
        nn.Linear(5, 6),
        nn.Tanh(),
        nn.Linear(6, 6),
        nn.Tanh(),
        nn.Linear(6, 6),
        nn.Tanh(),
        nn.Linear(6, 6),
        nn.Tanh(),
        nn.Linear(6, 3),
    )


def _cnn():
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(3, 3, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(3, 3, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(3 * 16, 3),
    )


#: name -> (model maker, input maker)
MODELS = {
    "mlp": (_mlp, lambda g: torch.randn(8, 5, generator=g, dtype=torch.float64)),
    "cnn": (_cnn, lambda g: torch.randn(8, 2, 4, 4, generator=g, dtype=torch.float64)),
    "transformer": (Transformer, lambda g: torch.randn(8, 5, 3, generator=g, dtype=torch.float64)),
}

#: name -> (batched class, per-layer class, options)
OPTIMIZERS = {
    "KFAC": (BatchedKFAC, LoopKFAC, {"curvature_interval": INTERVAL, "momentum": 0.5}),
    "KFAC-eigh": (
        BatchedKFAC,
        LoopKFAC,
        {"curvature_interval": INTERVAL, "kronecker_damping": "trace_norm_eigh"},
    ),
    "EKFAC": (
        BatchedEKFAC,
        LoopEKFAC,
        {"curvature_interval": INTERVAL, "basis_interval": INTERVAL},
    ),
    "DiagGGNNewton": (DiagGGNNewton, LoopDiagGGNNewton, {"curvature_interval": INTERVAL}),
}


def _trajectory(model, cls, options, make_input, seed=0):
    """The parameters after each of :data:`STEPS` steps, and the optimizer."""
    torch.manual_seed(seed)
    model = curvopt.extend(model)
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    opt = cls(model.parameters(), lr=0.1, damping=0.1, **options)
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        X = make_input(generator)
        y = torch.randint(0, 3, (X.shape[0],), generator=generator)
        opt.zero_grad()
        lossfunc(model(X), y).backward()
        opt.step()
        out.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    return out, opt


@pytest.mark.filterwarnings("ignore:.*no Kronecker factorisation")
@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_batched_steps_are_the_per_layer_loops(name, model_name):
    make_model, make_input = MODELS[model_name]
    batched_cls, loop_cls, options = OPTIMIZERS[name]
    torch.manual_seed(0)
    model = make_model().double()
    batched, opt = _trajectory(copy.deepcopy(model), batched_cls, options, make_input)
    looped, _ = _trajectory(copy.deepcopy(model), loop_cls, options, make_input)
    for step, (a, b) in enumerate(zip(batched, looped)):
        scale = b.abs().max()
        assert (a - b).abs().max() <= 1e-12 * scale, f"step {step}"
    if name == "DiagGGNNewton":  # element-wise: the same operations, the same bits
        assert all(torch.equal(a, b) for a, b in zip(batched, looped))
    else:  # the blocks of equal shapes were stacked (a bucket of two or more)
        kept = opt._stacks()._kept
        assert kept and max(len(sources) for sources, _ in kept.values()) >= 2


@pytest.mark.filterwarnings("ignore:.*no Kronecker factorisation")
def test_stacks_are_kept_between_refreshes_and_formed_anew_after_one():
    """The stacked inverses of a plain step are those of the step before (no new stack); a
    refresh replaces the cached inverses, and the next step stacks them anew."""
    torch.manual_seed(0)
    model = curvopt.extend(_mlp().double())
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    opt = BatchedKFAC(model.parameters(), lr=0.1, damping=0.1, curvature_interval=INTERVAL)
    generator = torch.Generator().manual_seed(0)
    stacks = []
    for _ in range(2 * INTERVAL):
        X = torch.randn(8, 5, generator=generator, dtype=torch.float64)
        opt.zero_grad()
        lossfunc(model(X), torch.randint(0, 3, (8,), generator=generator)).backward()
        opt.step()
        stacks.append({key: stack for key, (_, stack) in opt._stacks()._kept.items()})
    keys = set(stacks[0])
    assert keys and all(set(s) == keys for s in stacks)
    for step in range(1, 2 * INTERVAL):
        kept = [stacks[step][k] is stacks[step - 1][k] for k in keys]
        assert all(kept) == (step % INTERVAL != 0), f"step {step}"


def test_stacks_stack_again_only_for_new_sources():
    stacks = Stacks()
    a, b = torch.eye(2), 2 * torch.eye(2)
    first = stacks.stacked("k", [a, b])
    assert torch.equal(first, torch.stack([a, b]))
    assert stacks.stacked("k", [a, b]) is first
    c = b.clone()  # equal values, another tensor: a refresh's
    assert stacks.stacked("k", [a, c]) is not first
    assert stacks.stacked("k", [a]).shape == (1, 2, 2)


def test_buckets_group_positions_by_key_and_leave_none_out():
    assert buckets(["a", None, "b", "a"]) == {"a": [0, 3], "b": [2]}


@pytest.mark.filterwarnings("ignore:.*no Kronecker factorisation")
def test_stacks_are_not_saved():
    torch.manual_seed(0)
    model = curvopt.extend(_mlp().double())
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    opt = BatchedKFAC(model.parameters(), lr=0.1, damping=0.1, curvature_interval=INTERVAL)
    X = torch.randn(8, 5, dtype=torch.float64)
    lossfunc(model(X), torch.randint(0, 3, (8,))).backward()
    opt.step()
    assert opt._stacks()._kept
    assert "_stacked" not in opt.__getstate__()
    assert "_stacked" not in copy.deepcopy(opt).__dict__


@pytest.mark.filterwarnings("ignore:.*no Kronecker factorisation")
@pytest.mark.parametrize("cls", [KFAC, EKFAC])
def test_a_cpu_step_applies_its_blocks_one_by_one(cls):
    """Batches pay on an accelerator, not on a CPU: there the default optimizers stack
    nothing, and their steps are the per-layer loop's."""
    assert batches_pay(torch.device("cuda")) and not batches_pay(torch.device("cpu"))
    torch.manual_seed(0)
    model = curvopt.extend(_mlp().double())
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    options = {"basis_interval": INTERVAL} if cls is EKFAC else {}
    opt = cls(model.parameters(), lr=0.1, damping=0.1, curvature_interval=INTERVAL, **options)
    for _ in range(2):
        opt.zero_grad()
        lossfunc(
            model(torch.randn(8, 5, dtype=torch.float64)), torch.randint(0, 3, (8,))
        ).backward()
        opt.step()
    assert not opt._stacks()._kept
