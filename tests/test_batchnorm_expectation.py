"""BatchNorm in training mode: the Monte-Carlo curvature of the loss *as computed*, batch
statistics included, checked in expectation against ``torch.func`` on the whole-batch function.

With batch statistics the per-sample Jacobians couple samples; one backward pass of the
sampled loss through that coupled graph gives, at every module output, ``sum_n J_nᵀ s_n`` with
``E[s_n s_mᵀ] = δ_nm H_n`` (``engine.curvature``, "Coupled passes"). Averaged over many
draws (``mc_samples`` columns per pass, ``PASSES`` passes with their own seeds), the estimates
must match, entry by entry, within ``SIGMAS`` standard errors measured from the passes:

* ``diag_ggn_mc`` against ``diag(Jᵀ H J)``, ``J`` the Jacobian of the batch's logits w.r.t. all
  parameters (``jacrev`` of the whole-batch function), ``H`` the loss Hessian w.r.t. them;
* ``kfac`` of a weight between two BatchNorms: the output side against its coupled definition
  ``sum_n sum_p (∂f/∂z_np)ᵀ H (∂f/∂z_np)`` (``z`` the layer output, ``p`` its positions), the
  input side exactly against ``mean_{n,p} x xᵀ``;
* ``kfac`` of every one-dimensional parameter (BatchNorm's scale and shift, biases) against the
  exact GGN block; a bias right before a BatchNorm has a zero block (the mean cancels it),
  which a sum of per-sample squares would not give.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, hessian, jacrev

import curvopt
from curvopt import extensions as ext

DT = torch.float64
MC = 64  # Monte-Carlo columns per pass
PASSES = 40  # passes, each with its own seed: the standard errors come from their spread
SIGMAS = 5.0


class ResBlock(nn.Module):
    """conv -> BN -> ReLU -> conv -> BN, plus the skip, -> ReLU -> linear head."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 3, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(3)
        self.conv2 = nn.Conv2d(3, 3, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(3)
        self.head = nn.Linear(3 * 4 * 4, 3)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(h + self.bn2(self.conv2(h)))
        return self.head(h.flatten(1))


def mlp():
    return nn.Sequential(
        nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(),
        nn.Linear(6, 5), nn.BatchNorm1d(5), nn.ReLU(),
        nn.Linear(5, 3),
    )  # fmt: skip


def _problem(kind, loss, reduction):
    torch.manual_seed(0)
    if kind == "mlp":
        model, X = mlp().to(DT), torch.randn(8, 4, dtype=DT)
        layer, before, after = "3", lambda m: m[:3], lambda m: m[4:]
    else:
        model, X = ResBlock().to(DT), torch.randn(6, 2, 4, 4, dtype=DT)
        layer = "conv2"

        def before(m):
            return lambda x: F.relu(m.bn1(m.conv1(x)))

        def after(m):  # z = conv2's output, h its input (the skip)
            return lambda z, h: m.head(F.relu(h + m.bn2(z)).flatten(1))

    for m in model.modules():  # not the defaults: BatchNorm's own blocks are not trivial
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.normal_(0, 0.3)
    n = X.shape[0]
    if loss == "ce":
        lossfunc = nn.CrossEntropyLoss(reduction=reduction)
        y = torch.randint(0, 3, (n,))
    else:
        lossfunc = nn.MSELoss(reduction=reduction)
        y = torch.randn(n, 3, dtype=DT)
    return model, X, y, lossfunc, layer, before, after


def _pure(model):
    """A plain copy normalising with batch statistics and no buffers (torch.func-friendly)."""
    plain = copy.deepcopy(model)
    for m in plain.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.track_running_stats = False
            m.running_mean = m.running_var = m.num_batches_tracked = None
    return plain


def _reference(plain, X, y, lossfunc, layer, before, after):
    """``(G, {name: slice}, B_ref, A_ref)``: the batch GGN over all parameters (flattened in
    ``named_parameters`` order) and the coupled output side / input side of ``layer``."""
    names = [k for k, _ in plain.named_parameters()]
    params = {k: p.detach() for k, p in plain.named_parameters()}
    shapes = [params[k].shape for k in names]
    sizes = [params[k].numel() for k in names]
    flat = torch.cat([params[k].flatten() for k in names])

    def logits(theta):
        parts = dict(zip(names, (t.view(s) for t, s in zip(theta.split(sizes), shapes))))
        return functional_call(plain, parts, (X,))

    out = logits(flat).detach()
    H = hessian(lambda o: lossfunc(o.view(out.shape), y))(out.flatten())  # [NC, NC]
    J = jacrev(lambda t: logits(t).flatten())(flat)  # [NC, P]
    G = J.T @ H @ J
    offsets, index = torch.cumsum(torch.tensor([0] + sizes), 0).tolist(), {}
    for k, a, b in zip(names, offsets, offsets[1:]):
        index[k] = slice(a, b)
    with torch.no_grad():
        lin = plain.get_submodule(layer)
        if isinstance(plain, nn.Sequential):
            x = before(plain)(X)
            z = lin(x)
            tail = after(plain)
            Jz = jacrev(lambda z_: tail(z_).flatten())(z)  # [NC, N, O]
            Jz = Jz.unsqueeze(-1)  # one position
            A = x.T @ x / x.shape[0]
        else:
            h = before(plain)(X)
            z = lin(h)
            tail = after(plain)
            Jz = jacrev(lambda z_: tail(z_, h).flatten())(z)  # [NC, N, O, H, W]
            Jz = Jz.flatten(3)
            patches = F.unfold(h, 3, padding=1).transpose(1, 2).flatten(0, 1)  # [N P, I]
            A = patches.T @ patches / patches.shape[0]
    B = torch.einsum("anop,ab,bnqp->oq", Jz, H, Jz)
    return G, index, B, A


def _estimates(model, X, y, lossfunc, layer):
    """Per pass: ``diag_ggn_mc`` (flattened, all parameters), the layer's ``kfac`` factors,
    every one-dimensional parameter's ``kfac`` block."""
    ext_model = curvopt.extend(model)
    ext_loss = curvopt.extend(lossfunc)
    diags, outs, blocks = [], [], []
    for seed in range(PASSES):
        ext_model.zero_grad()
        loss = ext_loss(ext_model(X), y)
        torch.manual_seed(1000 + seed)
        with curvopt.collect(ext.DiagGGNMC(mc_samples=MC), ext.KFAC(mc_samples=MC)):
            loss.backward()
        params = list(ext_model.named_parameters())
        diags.append(torch.cat([p.diag_ggn_mc.flatten() for _, p in params]))
        w = ext_model.get_submodule(layer).weight
        outs.append(w.kfac[0].clone())
        A = w.kfac[1].clone()
        blocks.append({k: p.kfac[0].clone() for k, p in params if p.dim() == 1})
    return torch.stack(diags), torch.stack(outs), A, blocks


def _within(samples, exact, what, scale):
    """Mean of ``samples`` (``[PASSES, ...]``) within ``SIGMAS`` standard errors of ``exact``
    (plus a rounding floor, relative to ``scale``); returns the largest standard error
    relative to ``scale``, for the record."""
    mean = samples.mean(0)
    se = samples.std(0) / PASSES**0.5
    floor = 1e-10 * scale
    gap = (mean - exact).abs()
    bad = gap > SIGMAS * se + floor
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} entries off by more than {SIGMAS} standard errors; worst "
        f"gap/se {float((gap / (se + floor)).max()):.1f}"
    )
    return float((se / scale).max())


CASES = [
    (kind, loss, r) for kind in ("mlp", "cnn") for loss in ("ce", "mse") for r in ("mean", "sum")
]


@pytest.mark.parametrize("kind,loss,reduction", CASES)
def test_monte_carlo_curvature_is_unbiased_with_batch_statistics(kind, loss, reduction):
    model, X, y, lossfunc, layer, before, after = _problem(kind, loss, reduction)
    G, index, B_ref, A_ref = _reference(_pure(model), X, y, lossfunc, layer, before, after)
    model.train()
    diags, outs, A, blocks = _estimates(model, X, y, lossfunc, layer)

    scale = float(torch.diagonal(G).max())
    errors = [_within(diags, torch.diagonal(G), "diag_ggn_mc vs diag(G)", scale)]
    errors.append(_within(outs, B_ref, f"kfac B of {layer}", float(B_ref.diagonal().max())))
    torch.testing.assert_close(A, A_ref, rtol=1e-10, atol=1e-12)
    for name in blocks[0]:
        s = index[name]
        block = torch.stack([b[name] for b in blocks])
        errors.append(_within(block, G[s, s], f"kfac block of {name}", scale))
    # the test has power: 5 standard errors stay below 25% of the largest entry (measured: at
    # most 2.9%, the worst gap 3.2 standard errors; a sum of per-sample squares, the estimator
    # of independent samples, is off by 69 to 124 standard errors on these cases)
    assert max(errors) < 0.05, errors


def test_bias_before_batchnorm_has_no_curvature():
    """The mean subtraction cancels a bias right before BatchNorm: its GGN block is zero, and
    so is the estimate of every pass (a sum of per-sample squares would be positive)."""
    model, X, y, lossfunc, layer, *_ = _problem("mlp", "ce", "mean")
    model.train()
    diags, outs, A, blocks = _estimates(model, X, y, lossfunc, layer)
    for b in blocks:
        assert b["0.bias"].abs().max() < 1e-12 * b["1.weight"].abs().max()
    assert diags[:, 24:30].abs().max() < 1e-12 * diags.abs().max()  # 0.bias: after 6 x 4 weights
