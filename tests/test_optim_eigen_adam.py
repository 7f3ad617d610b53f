"""``EigenAdam``: Adam in the eigenbasis of the averaged Kronecker factors (issue 53, item 3),
float64.

* its stages against their formulas written out: a hand loop over the factors read from
  ``p.kflr`` (EMA, eigenbasis every ``basis_interval`` steps as ``Q = Q_B ⊗ Q_A``, the moments
  carried as ``Q'ᵀ Q m`` and ``(Q'ᵀ Q)² v``, Adam's step, decoupled weight decay);
* ``carry_moments`` against the full Kronecker formula, and on an unchanged, permuted or
  sign-flipped basis;
* in the identity basis (``basis="identity"``) it is ``torch.optim.Adam`` / ``AdamW`` to 1e-12;
* a ``state_dict`` loaded with ``weights_only=True`` gives the same next steps;
* it trains a small MLP and a small CNN;
* a parameter without Kronecker factors steps as Adam (``fallback="adam"``, announced once).
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from torch import nn

import curvopt
from curvopt.errors import UnsupportedKroneckerError
from curvopt.optim import EigenAdam, stages
from curvopt.optim.stages.eigenbasis import carry_moments

DT = torch.float64


def _mlp(seed=0):
    torch.manual_seed(seed)
    return curvopt.extend(nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DT))


def _batches(count, n=8, inputs=4, classes=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(n, inputs, generator=g, dtype=DT),
            torch.randint(0, classes, (n,), generator=g),
        )
        for _ in range(count)
    ]


def _step(model, opt, batch, lossfunc=None):
    lossfunc = lossfunc or curvopt.extend(nn.CrossEntropyLoss())
    opt.zero_grad()
    loss = lossfunc(model(batch[0]), batch[1])
    loss.backward()
    opt.step()
    return loss.item()


# ---------------------------------------------------------------------- the formulas
def _orthogonal(d, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(d, d, generator=g, dtype=DT))[0].contiguous()


def test_carry_moments_is_the_full_kronecker_rotation_and_projection():
    """``m ← Q'ᵀ Q m`` and ``v ← (Q'ᵀ Q)² v`` with ``Q = Q_B ⊗ Q_A`` (row-major ``vec``)."""
    old = [_orthogonal(3, 0), _orthogonal(4, 1)]
    new = [_orthogonal(3, 2), _orthogonal(4, 3)]
    g = torch.Generator().manual_seed(4)
    m, v = torch.randn(3, 4, generator=g, dtype=DT), torch.rand(3, 4, generator=g, dtype=DT)
    turn = torch.kron(*new).T @ torch.kron(*old)
    m_new, v_new = carry_moments(m, v, old, new)
    torch.testing.assert_close(m_new.reshape(-1), turn @ m.reshape(-1), rtol=0, atol=1e-13)
    torch.testing.assert_close(v_new.reshape(-1), turn.square() @ v.reshape(-1), rtol=0, atol=1e-13)
    assert bool((v_new >= 0).all()) and torch.isclose(v_new.sum(), v.sum())
    # identity sides (None): the old basis the identity, a new one-sided basis
    m_id, v_id = carry_moments(m, v, None, [new[0], None])
    turn = torch.kron(new[0], torch.eye(4, dtype=DT)).T
    torch.testing.assert_close(m_id.reshape(-1), turn @ m.reshape(-1), rtol=0, atol=1e-13)
    torch.testing.assert_close(v_id.reshape(-1), turn.square() @ v.reshape(-1), rtol=0, atol=1e-13)


def test_carry_moments_keeps_v_on_the_same_basis_and_permutes_it_on_a_reordered_one():
    q = [_orthogonal(3, 0), _orthogonal(4, 1)]
    g = torch.Generator().manual_seed(2)
    m, v = torch.randn(3, 4, generator=g, dtype=DT), torch.rand(3, 4, generator=g, dtype=DT)
    same = carry_moments(m, v, q, q)
    torch.testing.assert_close(same[0], m, rtol=0, atol=1e-14)
    torch.testing.assert_close(same[1], v, rtol=0, atol=1e-14)
    order, signs = torch.tensor([2, 0, 1]), torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=DT)
    moved = carry_moments(m, v, q, [q[0][:, order], q[1] * signs])
    torch.testing.assert_close(moved[0], m[order] * signs, rtol=0, atol=1e-14)
    torch.testing.assert_close(moved[1], v[order], rtol=0, atol=1e-14)


def _factors(param):
    return [f.detach().clone() for f in param.kflr]


def test_the_stages_follow_their_formulas_over_basis_refreshes():
    """Seven steps, the basis refreshed every 3 (steps 0, 3, 6), against a loop of the
    formulas over ``vec`` and ``Q = Q_B ⊗ Q_A`` (``[Q_B]`` for the biases). The other
    parameters agree to 1e-16; the output weight's ``B`` has the softmax's null direction
    ``1``, where ``G'`` is round-off that Adam divides by ``sqrt(v̂) + ε`` (2e-13 for
    ``ε = 1e-6``, 2e-11 for ``1e-8``)."""
    lr, (beta1, beta2), eps, delta, ema, interval = 0.05, (0.9, 0.99), 1e-6, 0.1, 0.5, 3
    model, reference = _mlp(), _mlp()
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    opt = EigenAdam(
        model.parameters(),
        lr,
        (beta1, beta2),
        eps,
        delta,
        curvature="kflr",
        curvature_ema=ema,
        basis_interval=interval,
    )
    kept = {}  # name -> averaged factors, Q, m, v (vectors in the basis)
    for t, batch in enumerate(_batches(7)):
        opt.zero_grad()
        lossfunc(model(batch[0]), batch[1]).backward()
        for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
            factors, grad = _factors(p), p.grad.reshape(-1)
            s = kept.setdefault(name, {})
            if "F" in s:
                factors = [
                    torch.lerp(f, a, ema) for a, f in zip(s["F"], factors)
                ]  # β a + (1 − β) f
            s["F"] = factors
            if t % interval == 0:
                q_new = torch.linalg.eigh(factors[0])[1]
                for f in factors[1:]:
                    q_new = torch.kron(q_new, torch.linalg.eigh(f)[1])
                if "m" in s:
                    turn = q_new.T @ s["Q"]
                    s["m"], s["v"] = turn @ s["m"], turn.square() @ s["v"]
                s["Q"] = q_new
            rotated = s["Q"].T @ grad
            s["m"] = beta1 * s.get("m", 0 * rotated) + (1 - beta1) * rotated
            s["v"] = beta2 * s.get("v", 0 * rotated) + (1 - beta2) * rotated.square()
            m_hat, v_hat = s["m"] / (1 - beta1 ** (t + 1)), s["v"] / (1 - beta2 ** (t + 1))
            update = s["Q"] @ (m_hat / (v_hat.sqrt() + eps))
            with torch.no_grad():
                ref -= lr * (update.reshape(ref.shape) + delta * ref)
        opt.step()
        for p, ref in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p, ref, rtol=0, atol=1e-12)
            with torch.no_grad():
                ref.copy_(p)  # the next gradient at the same point


def test_decoupled_weight_decay_is_not_preconditioned():
    """With ``lr`` and a zero gradient the step is ``θ ← (1 − lr δ) θ`` exactly as AdamW's."""
    model = _mlp()
    opt = EigenAdam(model.parameters(), 0.1, weight_decay=0.5, basis="identity")
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for p, b in zip(model.parameters(), before):
        torch.testing.assert_close(p, b - 0.1 * 0.5 * b, rtol=0, atol=1e-15)


def test_the_chain_is_the_existing_stages_and_the_new_ones():
    kinds = [type(s) for s in EigenAdam.stages]
    assert kinds == [
        stages.AverageCurvature,
        stages.RefreshEigenbasis,
        stages.EigenbasisAdam,
        stages.DecoupledWeightDecay,
        stages.ScaleByLearningRate,
        stages.ScheduleFree,
    ]


# ---------------------------------------------------------------------- the peers
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_the_identity_basis_is_adam_and_adamw(weight_decay):
    model, peer = _mlp(), _mlp()
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    opt = EigenAdam(model.parameters(), 3e-2, (0.9, 0.999), 1e-8, weight_decay, basis="identity")
    peer_class = torch.optim.AdamW if weight_decay else torch.optim.Adam
    peer_opt = peer_class(peer.parameters(), 3e-2, (0.9, 0.999), 1e-8, weight_decay)
    for batch in _batches(6):
        _step(model, opt, batch, lossfunc)
        _step(peer, peer_opt, batch, lossfunc)
        for p, q in zip(model.parameters(), peer.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-12)
    assert all(not hasattr(p, "kfac") for p in model.parameters())  # nothing collected


# ---------------------------------------------------------------------- saving
def test_a_state_dict_loaded_with_weights_only_gives_the_same_next_steps():
    model = _mlp()
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    make = lambda m: EigenAdam(m.parameters(), 1e-2, curvature="kflr", basis_interval=2)
    opt, batches = make(model), _batches(6)
    for batch in batches[:3]:
        _step(model, opt, batch, lossfunc)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    twin = _mlp(seed=5)  # a model of its own (a deep copy would share the extended hooks)
    twin.load_state_dict(model.state_dict())
    twin_opt = make(twin)
    twin_opt.load_state_dict(torch.load(buffer, weights_only=True))
    for batch in batches[3:]:  # a basis step (4) among them
        _step(model, opt, batch, lossfunc)
        _step(twin, twin_opt, batch, lossfunc)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


# ---------------------------------------------------------------------- training
def _teacher_data(make_inputs, teacher, n=64, seed=3):
    torch.manual_seed(seed)
    X = make_inputs(n)
    with torch.no_grad():
        y = teacher(X).argmax(1)
    return X, y


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_it_trains_a_small_mlp_and_cnn(kind):
    torch.manual_seed(0)
    if kind == "mlp":
        net = lambda: nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
        inputs = lambda n: torch.randn(n, 6, dtype=DT)
    else:
        net = lambda: nn.Sequential(
            nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 4)
        )
        inputs = lambda n: torch.randn(n, 1, 6, 6, dtype=DT)
    X, y = _teacher_data(inputs, net().to(DT))
    model = curvopt.extend(net().to(DT))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    opt = EigenAdam(model.parameters(), lr=1e-2, basis_interval=5)
    losses = [_step(model, opt, (X, y), lossfunc) for _ in range(60)]
    assert losses[-1] < 0.3 * losses[0], losses[::10]


# ---------------------------------------------------------------------- the fallback
class ExpMix(nn.Module):
    """``x @ exp(w)``: a weight used non-linearly, without Kronecker factors."""

    def __init__(self, d: int):
        super().__init__()
        self.w = nn.Parameter(0.1 * torch.randn(d, d))

    def forward(self, x):
        return x @ torch.exp(self.w)


def _net_with_mix():
    torch.manual_seed(0)
    return curvopt.extend(
        nn.Sequential(nn.Linear(4, 4), nn.Tanh(), ExpMix(4), nn.Linear(4, 3)).to(DT)
    )


def test_a_parameter_without_factors_steps_as_adam_and_is_announced_once():
    model = _net_with_mix()
    mix = model[2].w
    lr, betas, eps = 1e-2, (0.9, 0.99), 1e-8
    opt = EigenAdam(model.parameters(), lr, betas, eps, basis_interval=2)
    shadow = nn.Parameter(mix.detach().clone())  # torch.optim.Adam on mix's gradients
    shadow_opt = torch.optim.Adam([shadow], lr, betas, eps)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in _batches(5):
            opt.zero_grad()
            curvopt.extend(nn.CrossEntropyLoss())(model(batch[0]), batch[1]).backward()
            shadow.grad = mix.grad.clone()
            opt.step()
            shadow_opt.step()
            torch.testing.assert_close(mix, shadow, rtol=0, atol=1e-12)
    announced = [w for w in caught if "Adam in the identity basis" in str(w.message)]
    assert len(announced) == 1 and "fallback='adam'" in str(announced[0].message)
    assert "eigenbasis" in opt.state[model[0].weight]  # the others have their basis


def test_fallback_none_raises_for_a_parameter_without_factors():
    model = _net_with_mix()
    opt = EigenAdam(model.parameters(), fallback=None)
    with pytest.raises((UnsupportedKroneckerError, RuntimeError)):
        _step(model, opt, _batches(1)[0])


# ---------------------------------------------------------------------- options
@pytest.mark.parametrize(
    "options",
    [
        {"betas": (0.9, 1.0)},
        {"betas": 0.9},
        {"eps": -1.0},
        {"basis": "shampoo"},
        {"basis_interval": 0},
    ],
)
def test_invalid_options_raise(options):
    with pytest.raises(ValueError):
        EigenAdam(_mlp().parameters(), **options)


@pytest.mark.parametrize("option", [{"momentum": 0.9}, {"kl_clip": 1e-3}, {"damping": 1e-3}])
def test_the_newton_options_it_does_not_run_are_refused(option):
    model = _mlp()
    with pytest.raises((ValueError, TypeError)):
        EigenAdam(model.parameters(), **option)
    with pytest.raises(ValueError):
        EigenAdam([{"params": list(model.parameters()), **option}])


def test_schedule_free_evaluates_at_the_average():
    model = _mlp()
    opt = EigenAdam(model.parameters(), 1e-2, (0.9, 0.99), schedule_free=0.9, basis_interval=2)
    for batch in _batches(4):
        _step(model, opt, batch)
    y = [p.detach().clone() for p in model.parameters()]
    opt.eval()
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), y))
    opt.train()
    for p, q in zip(model.parameters(), y):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-14)
