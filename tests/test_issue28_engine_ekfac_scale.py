"""``EKFAC``'s scale ``c``: ``S = c · Σ_n (Q_0ᵀ G_n Q_1)²`` with ``c = D``, the loss's divisor
(``N`` for one term per sample, the counted rows of a flattened sequence cross-entropy, ``N K``
for ``MSELoss("mean")`` and ``BCEWithLogitsLoss("mean")`` with ``K`` outputs, 1 for "sum").

Two references in float64: per-sample gradients from a loop over samples (sample ``n``'s
output recomputed with the graph, the others detached) with ``D`` counted from the targets;
and, in expectation, the GGN diagonal in the same basis (``torch.func`` Jacobians and the loss
Hessian): the average of ``S`` over targets drawn from the model's predictive distribution
approaches ``diag(Qᵀ G Q)`` (George et al., 2018), which ``c = N`` misses by ``T`` or ``K``."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.func import functional_call, hessian, jacrev

import curvopt
from curvopt import extensions as ext

DT = torch.float64
N, T, K = 4, 3, 3


class Tokens(nn.Module):
    """``[N, T, 4]`` through Linear, LayerNorm, tanh, Linear: logits ``[N, T, K]``."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 5)
        self.norm = nn.LayerNorm(5)
        self.out = nn.Linear(5, K)

    def forward(self, x):
        return self.out(torch.tanh(self.norm(self.inp(x))))


def _mlp():
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, K))


def _flat(lossfunc):
    return lambda out, y: lossfunc(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _cross_entropy_divisor(reduction, y):
    return int((y != -100).sum()) if reduction == "mean" else 1


def _elementwise_divisor(reduction, y):
    return y.numel() if reduction == "mean" else 1


def _case(name, reduction):
    """``(model, loss module, loss_of(out, y), x, y, D)``."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "mlp_ce":
        model, lossfunc = _mlp(), nn.CrossEntropyLoss(reduction=reduction)
        x, y = torch.randn(N, 4, generator=g, dtype=DT), torch.randint(0, K, (N,), generator=g)
        loss_of, divisor = lossfunc, _cross_entropy_divisor
    elif name.startswith("tokens_ce"):
        model, lossfunc = Tokens(), nn.CrossEntropyLoss(reduction=reduction)
        x = torch.randn(N, T, 4, generator=g, dtype=DT)
        y = torch.randint(0, K, (N, T), generator=g)
        if name.endswith("ignore"):
            y[0, 1] = y[2, 0] = y[2, 2] = -100
        loss_of, divisor = _flat(lossfunc), _cross_entropy_divisor
    elif name == "mlp_bce":
        model, lossfunc = _mlp(), nn.BCEWithLogitsLoss(reduction=reduction)
        x = torch.randn(N, 4, generator=g, dtype=DT)
        y = torch.randint(0, 2, (N, K), generator=g).to(DT)
        loss_of, divisor = lossfunc, _elementwise_divisor  # one term per output too
    else:  # mlp_mse
        model, lossfunc = _mlp(), nn.MSELoss(reduction=reduction)
        x, y = torch.randn(N, 4, generator=g, dtype=DT), torch.randn(N, K, generator=g, dtype=DT)
        loss_of, divisor = lossfunc, _elementwise_divisor
    return model.to(DT), lossfunc, loss_of, x, y, divisor(reduction, y)


CASES = ["mlp_ce", "tokens_ce", "tokens_ce_ignore", "mlp_mse", "mlp_bce"]


def _per_sample_grads(model, loss_of, x, y):
    """``{name: [N, *p.shape]}``: ``g_n``, the loss's gradient through sample ``n``'s output
    alone (the other samples' outputs detached), one backward pass per sample."""
    params = dict(model.named_parameters())
    detached = model(x).detach()
    rows = []
    for n in range(len(x)):
        out = torch.cat([detached[:n], model(x[n : n + 1]), detached[n + 1 :]])
        rows.append(torch.autograd.grad(loss_of(out, y), list(params.values())))
    return {k: torch.stack([r[i] for r in rows]) for i, k in enumerate(params)}


def _orthogonal_bases(model):
    bases, g = {}, torch.Generator().manual_seed(7)
    for p in model.parameters():
        sizes = [p.shape[0], p[0].numel()] if p.dim() > 1 else [p.shape[0]]
        bases[p] = [torch.linalg.qr(torch.randn(s, s, generator=g, dtype=DT))[0] for s in sizes]
    return bases


def _rotated_square(grad, bases):
    m = grad.reshape(bases[0].shape[0], -1)
    m = bases[0].T @ m
    return (m @ bases[1] if len(bases) == 2 else m) ** 2


def _ekfac_s(model, loss_of, x, y, bases):
    model.zero_grad()
    with curvopt.collect(ext.EKFAC(bases=bases)):
        loss_of(model(x), y).backward()
    return {k: p.ekfac[0] for k, p in model.named_parameters()}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", CASES)
def test_s_is_the_divisor_times_the_rotated_second_moment(name, reduction):
    model, lossfunc, loss_of, x, y, divisor = _case(name, reduction)
    grads = _per_sample_grads(model, loss_of, x, y)
    curvopt.extend(model), curvopt.extend(lossfunc)
    bases = _orthogonal_bases(model)
    written = _ekfac_s(model, loss_of, x, y, bases)
    for k, p in model.named_parameters():
        expected = divisor * sum(_rotated_square(g, bases[p]) for g in grads[k])
        torch.testing.assert_close(written[k], expected, rtol=1e-10, atol=1e-14)


def _ggn_diagonal_in_basis(model, loss_of, x, y, bases):
    """``{name: diag(Qᵀ G Q)}`` with ``G = Jᵀ (∂²L/∂out²) J`` per parameter (``torch.func``)."""
    params = {k: p.detach() for k, p in model.named_parameters()}
    out = model(x).detach()
    h = hessian(lambda o: loss_of(o, y))(out).reshape(out.numel(), out.numel())
    jac = jacrev(lambda ps: functional_call(model, ps, (x,)))(params)
    result = {}
    for k, p in model.named_parameters():
        j = jac[k].reshape(out.numel(), p.numel())
        q = bases[p][0] if len(bases[p]) == 1 else torch.kron(*bases[p])
        result[k] = torch.diagonal(q.T @ j.T @ h @ j @ q).reshape(bases[p][0].shape[0], -1)
    return result


def _draw_targets(name, out, y, g):
    """Targets from the model's predictive distribution: a class per counted row of the
    softmax (ignored rows stay ignored); for ``MSELoss`` the Gaussian ``N(out, 1/2)``, whose
    score has the per-element Hessian 2 of ``(out - y)²`` as covariance; for
    ``BCEWithLogitsLoss`` a Bernoulli draw per output."""
    if name == "mlp_mse":
        return out + math.sqrt(0.5) * torch.randn(out.shape, generator=g, dtype=DT)
    if name == "mlp_bce":
        return torch.bernoulli(torch.sigmoid(out), generator=g)
    probs = out.softmax(-1).reshape(-1, K)
    drawn = torch.multinomial(probs, 1, generator=g).reshape(y.shape)
    return torch.where(y == -100, y, drawn)


@pytest.mark.parametrize("name", CASES)
def test_s_averaged_over_sampled_targets_is_the_ggn_diagonal_in_the_basis(name):
    """With ``D`` the loss's divisor, ``E[S] = diag(Qᵀ G Q)``; ``c = N`` gives ``1/T`` or
    ``1/K`` of it (0.33 here), outside the tolerance of 400 draws."""
    model, lossfunc, loss_of, x, y, _ = _case(name, "mean")
    curvopt.extend(model), curvopt.extend(lossfunc)
    bases = _orthogonal_bases(model)
    expected = _ggn_diagonal_in_basis(model, loss_of, x, y, bases)
    out, g, draws = model(x).detach(), torch.Generator().manual_seed(3), 400
    total = {k: 0 for k in expected}
    for _ in range(draws):
        written = _ekfac_s(model, loss_of, x, _draw_targets(name, out, y, g), bases)
        total = {k: total[k] + written[k] for k in total}
    for k, ggn in expected.items():
        mean = total[k] / draws
        ratio = float(mean.sum() / ggn.sum())
        assert 0.9 < ratio < 1.1, (k, ratio)
        relative = float((mean - ggn).norm() / ggn.norm())
        assert relative < 0.12, (k, relative)


@pytest.mark.parametrize("value", [None, "Q", torch.eye(3)])
def test_a_bases_dict_with_a_value_that_is_not_a_list_of_tensors_raises_naming_it(value):
    p = nn.Linear(3, 3).weight
    with pytest.raises(TypeError, match=r"EKFAC: bases\[parameter of shape \(3, 3\)\].*fresh"):
        ext.EKFAC(bases={p: value})
