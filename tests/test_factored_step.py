"""KFAC's factored step ``(F_0⁻¹ leftᵀ)(F_1⁻¹ rightᵀ)ᵀ`` for layers wider than the batch
(``curvopt/optim/gradient_factors.py``, the rows from ``LayerRule.gradient_rows``): the same
steps as the dense product ``F_0⁻¹ G F_1⁻¹`` (float64), taken only where it is cheaper and the
captured factors give the gradient; for ``Linear``, convolutions, ``Embedding`` and ``Conv1D``."""

import pytest
import torch
from conftest import Conv1D
from torch import nn

import curvopt
from curvopt.optim import KFAC
from curvopt.optim import gradient_factors as gf


def _problem(seed=0, width=40):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(30, width), nn.Tanh(), nn.Linear(width, 5)).double()
    return curvopt.extend(model), curvopt.extend(nn.CrossEntropyLoss())


def _mlp_inputs(generator, batch):
    return torch.randn(batch, 30, generator=generator, dtype=torch.float64)


#: a first layer wider than the rows of a batch of 4 (so the factored form is cheaper), then
#: ``tanh``, flatten and a ``Linear`` head; the inputs of a batch
LAYERS = {
    "Conv2d": (
        lambda: nn.Conv2d(6, 40, 3),
        lambda g, n: torch.randn(n, 6, 4, 4, generator=g, dtype=torch.float64),
        160,
    ),
    "Embedding": (
        lambda: nn.Embedding(40, 30),
        lambda g, n: torch.randint(0, 40, (n, 2), generator=g),
        60,
    ),
    "Conv1D": (lambda: Conv1D(40, 30), _mlp_inputs, 40),
}


def _layer_problem(kind):
    def problem(seed=0):
        torch.manual_seed(seed)
        build, _, features = LAYERS[kind]
        head = nn.Sequential(nn.Tanh(), nn.Flatten(), nn.Linear(features, 5))
        model = nn.Sequential(build(), head).double()
        return curvopt.extend(model), curvopt.extend(nn.CrossEntropyLoss())

    return problem


def _train(
    factored: bool,
    steps=6,
    batch=4,
    weight_decay=0.0,
    reuse=False,
    discarded=False,
    problem=_problem,
    inputs=_mlp_inputs,
    **options,
):
    """Parameters after each step, and ``(gradient matrix shape, factors usable)`` of each
    factored step considered; ``factored=False`` disables the factored form."""
    model, lossfunc = problem()
    opt = KFAC(model.parameters(), lr=0.1, damping=0.3, weight_decay=weight_decay, **options)
    taken = []
    original = gf.reproduces

    def spy(matrix, factors):
        ok = original(matrix, factors)
        taken.append((tuple(matrix.shape), ok))
        return ok and factored

    generator = torch.Generator().manual_seed(1)
    trajectory = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("curvopt.optim.kfac.reproduces", spy)
        for _ in range(steps):
            X = inputs(generator, batch)
            y = torch.randint(0, 5, (batch,), generator=generator)
            if discarded:  # a pass whose gradient is zeroed: its captured rows are not in p.grad
                lossfunc(model(X), y).backward()
            opt.zero_grad()
            out = model(X)
            if reuse:  # a second call of the first layer: the weight gets two uses' gradient
                out = out + 0.1 * model[2](torch.tanh(model[0](X)))
            loss = lossfunc(out, y)
            with opt.collect():
                loss.backward()
            opt.step()
            trajectory.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    return torch.stack(trajectory), taken


@pytest.mark.parametrize(
    "options", [{}, {"curvature_interval": 3, "curvature_ema": 0.9}, {"reuse": True}]
)
def test_factored_steps_equal_the_dense_ones(options):
    """Also with the first layer called twice: the rows of both calls are the factors."""
    factored, taken = _train(True, **options)
    dense, _ = _train(False, **options)
    assert any(ok for _, ok in taken), "the factored form must have been taken"
    torch.testing.assert_close(factored, dense, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", list(LAYERS))
def test_factored_steps_of_other_layers_equal_the_dense_ones(kind):
    """The rows their rules give (patches, one-hot tokens, the transposed layout)."""
    options = {"problem": _layer_problem(kind), "inputs": LAYERS[kind][1], "curvature_ema": 0.9}
    factored, taken = _train(True, **options)
    dense, _ = _train(False, **options)
    weight = _layer_problem(kind)()[0][0].weight
    first = tuple(weight.reshape(weight.shape[0], -1).shape)
    assert any(ok for shape, ok in taken if shape == first), "the factored form must be taken"
    torch.testing.assert_close(factored, dense, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", ["weight_decay", "discarded"])
def test_factors_that_do_not_give_the_gradient_are_not_used(case):
    kwargs = {"weight_decay": 1e-2} if case == "weight_decay" else {"discarded": True}
    factored, taken = _train(True, **kwargs)
    dense, _ = _train(False, **kwargs)
    assert taken and not any(ok for _, ok in taken[len(taken) // 2 :])  # the probe refuses them
    torch.testing.assert_close(factored, dense, rtol=0, atol=0)


def test_reproduces_checks_the_product_to_its_rounding():
    torch.manual_seed(0)
    a, b = torch.randn(6, 9), torch.randn(6, 4)
    grad = b.T @ a
    assert gf.reproduces(grad, (b, a))
    wrong = grad.clone()
    wrong[1, 2] += 1e-3 * grad.abs().max()
    assert not gf.reproduces(wrong, (b, a))
    assert not gf.reproduces(grad + 1e-2 * torch.randn(4, 9), (b, a))


def test_factored_is_chosen_by_flops():
    dense = [torch.eye(1024), torch.eye(3136)]
    assert gf.factored_cheaper(dense, 1024, 3136, 128)  # FMNIST 2C2D's fc1 at batch 128
    assert not gf.factored_cheaper(dense, 1024, 3136, 2048)
    assert not gf.factored_cheaper([torch.eye(10), torch.eye(20)], 10, 20, 64)


def test_rows_that_are_not_cheaper_are_formed_once_not_at_every_step(monkeypatch):
    """A convolution over many positions (``R`` = 4 samples x 100 positions, dense product
    cheaper): its rows are formed at the first step only, later steps with the same shapes skip
    them from the known count; the dense layer's (cheaper) rows are formed at every step."""
    calls = {"conv": 0, "linear": 0}
    for key, module in (("conv", nn.Conv2d(1, 1, 1)), ("linear", nn.Linear(1, 1))):
        rule = curvopt.layers.rule_for(module)
        original = rule.gradient_rows

        def counted(call, name, original=original, key=key):
            calls[key] += 1
            return original(call, name)

        monkeypatch.setattr(rule, "gradient_rows", counted)
    torch.manual_seed(0)
    model = curvopt.extend(
        nn.Sequential(
            nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Linear(300, 40), nn.Tanh(), nn.Linear(40, 3)
        ).double()
    )
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    opt = KFAC(model.parameters(), lr=0.1, damping=0.1, curvature="kflr")
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(4, 2, 12, 12, generator=g, dtype=torch.float64)
        y = torch.randint(0, 3, (4,), generator=g)
        opt.zero_grad()
        with opt.collect():
            lossfunc(model(x), y).backward()
        opt.step()
    assert calls["conv"] == 1
    assert calls["linear"] >= 3  # Linear(300, 40) at R = 4: factored at every step


def test_the_capture_taps_the_engines_records_and_registers_no_hook():
    """The calls come from the records ``extend``'s hooks make (``ModuleEntry.taps``): no
    hook is added to the model, the rows give the weight's gradient, and the tap goes with the
    optimizer."""
    import gc

    from curvopt.core.extended import module_entry

    model, lossfunc = _problem()
    hooks = [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]
    opt = KFAC(model.parameters(), lr=0.1, damping=0.3)
    generator = torch.Generator().manual_seed(0)
    X, y = _mlp_inputs(generator, 4), torch.randint(0, 5, (4,), generator=generator)
    with opt.collect():
        lossfunc(model(X), y).backward()
    assert [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()] == hooks
    entry = module_entry(model[0])
    assert entry.taps == [opt._capture]
    left, right = opt._capture.factors(model[0].weight)
    torch.testing.assert_close(left.mT @ right, model[0].weight.grad, rtol=1e-12, atol=1e-14)
    del opt
    gc.collect()
    assert entry.taps == []
