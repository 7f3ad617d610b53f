"""Independent torch.func references for the zoo tests (never touching curvopt).

They work on a *plain* model (before ``curvopt.extend``) and an :class:`fixtures.zoo.Problem`'s
``loss_on(out, y)``, with ``bd`` the sample axis of the input, the output and the target.

* :func:`per_sample_grads`: ``g_n = J_nᵀ ∂L/∂out_n`` by ``vmap`` over samples of a ``vjp`` of the
  single-sample forward, with the cotangent ``∂L/∂out`` of the loss *as computed on the whole
  batch* (so ``reduction="mean"`` carries the loss's own ``1/(number of counted rows)``).
* :func:`per_sample_grads_replayed`: ``g_n`` by one eager backward of sample ``n``'s loss per
  sample, each after a forward of the whole batch from the same generator state (a model that
  draws random numbers in training mode: the same dropout masks; ``torch.func``'s transforms
  draw others).
* :func:`ggn` / :func:`hessian`: the helpers of ``conftest`` (``jacrev`` + loss Hessian w.r.t.
  the output; ``torch.func.hessian`` w.r.t. shared / per-sample parameter copies).
* :func:`kronecker`: KFLR factors from their definitions (Eschenhagen et al., 2023) with the GGN
  w.r.t. each layer output, ``G_z = J_zᵀ H J_z``; :func:`kfra`: Botev et al.'s recursion.
"""

from __future__ import annotations

from typing import Dict, List

import torch
import torch.nn.functional as F
from conftest import ggn_reference, hessian_reference, reduce_reference, trainable
from torch import nn
from torch.func import functional_call, grad, vjp, vmap


def per_sample_grads(plain: nn.Module, loss_on, X, y, bd: int = 0) -> Dict[str, torch.Tensor]:
    """``name -> [N, *p.shape]`` (see module docstring)."""
    params = {k: p.detach() for k, p in trainable(plain).items()}
    out = functional_call(plain, params, (X,)).detach()
    cotangent = grad(lambda o: loss_on(o, y))(out)

    def one(x, g):
        _, pullback = vjp(lambda p: functional_call(plain, p, (x.unsqueeze(bd),)), params)
        return pullback(g.unsqueeze(bd))[0]

    return vmap(one, in_dims=(bd, bd))(X, cotangent)


def per_sample_grads_replayed(plain: nn.Module, losses_of, state) -> Dict[str, torch.Tensor]:
    """``name -> [N, *p.shape]``: the gradients of ``losses_of(plain)[n]`` (the ``[N]`` losses
    of the samples, each as it enters the loss: ``1/N`` for a mean) w.r.t. the trainable
    parameters, every forward started from the generator state ``state``."""
    params = trainable(plain)
    rows = []
    with torch.random.fork_rng(devices=[]):
        n = None
        while n is None or len(rows) < n:
            torch.set_rng_state(state)
            losses = losses_of(plain)
            n = losses.shape[0]
            grads = torch.autograd.grad(losses[len(rows)], list(params.values()), allow_unused=True)
            rows.append([torch.zeros_like(p) if g is None else g
                         for g, p in zip(grads, params.values())])
    return {k: torch.stack([row[i] for row in rows]) for i, k in enumerate(params)}


def first_order(plain, loss_on, X, y, bd=0) -> Dict[str, Dict[str, torch.Tensor]]:
    """``name -> {attr: value}`` for the four first-order quantities of docs/conventions.md."""
    return {k: reduce_reference(g) for k, g in per_sample_grads(plain, loss_on, X, y, bd).items()}


def ggn(plain, loss_on, X, y, bd=0):
    """``(blocks, per_sample)``: exact GGN block ``[P, P]`` and per-sample diagonals per name."""
    return ggn_reference(plain, loss_on, X, y, out_dim=bd)


def hessian(plain, loss_on, X, y, bd=0):
    """``(diag, per_sample)``: Hessian diagonal and per-sample terms per name."""
    return hessian_reference(plain, loss_on, X, y, in_dim=bd, out_dim=bd)


# ------------------------------------------------------------------------------ Kronecker factors


def _layer_rows(module: nn.Module, x: torch.Tensor, bd: int):
    """``x`` as ``[groups, positions, features]`` rows of the input side ``A`` (unfolded
    patches for convolutions, one-hot tokens for embeddings); a layer whose input has no
    batch axis (a shared ``arange``) forms one group."""
    if isinstance(module, nn.Conv2d):
        cols = F.unfold(x, module.kernel_size, module.dilation, module.padding, module.stride)
        return cols.transpose(1, 2)
    if isinstance(module, nn.Embedding):
        x = F.one_hot(x, module.num_embeddings).to(module.weight.dtype)
        if x.dim() == 2:  # shared positions: [T, V]
            return x.unsqueeze(0)
    x = x.movedim(bd, 0)
    return x.reshape(x.shape[0], -1, x.shape[-1])


def _output_rows(module: nn.Module, z: torch.Tensor, bd: int):
    """The layer output (or its GGN) as ``[groups, positions, features]``, like ``_layer_rows``."""
    if isinstance(module, nn.Conv2d):
        return z.flatten(2).transpose(1, 2)
    if isinstance(module, nn.Embedding) and z.dim() == 2:
        return z.unsqueeze(0)
    z = z.movedim(bd, 0)
    return z.reshape(z.shape[0], -1, z.shape[-1])


def _hessian_sqrt(loss_on, out, y):
    """``S`` with ``S Sᵀ = ∂²L/∂out²`` (flattened), from an eigendecomposition."""
    h = torch.func.hessian(lambda o: loss_on(o, y))(out).reshape(out.numel(), out.numel())
    evals, evecs = torch.linalg.eigh(h)
    return evecs * evals.clamp(min=0).sqrt()


#: the layer types :func:`kronecker` factors by default
KRONECKER_TYPES = (nn.Linear, nn.Conv2d, nn.Embedding)


def kronecker(plain: nn.Module, loss_on, X, y, bd=0, approx="expand", types=KRONECKER_TYPES):
    """``module name -> (B, A)`` of every module of ``types`` called as a module (a type other
    than ``Conv2d`` and ``Embedding`` is taken as linear-like: ``x [N, *, I] -> z [N, *, O]``).

    With the layer's output ``z`` as rows ``z[g, r]`` (group ``g``: sample, position ``r``),
    input rows ``x[g, r]`` and ``G_z`` the exact GGN w.r.t. ``z``:

    * expand: ``B = Σ_{g,r} G_z[(g,r),(g,r)]``, ``A = mean_{g,r} x x ᵀ``;
    * reduce: ``B = Σ_g Σ_{r,r'} G_z[(g,r),(g,r')]``, ``A = mean_g x̄_g x̄_gᵀ``,
      ``x̄_g = mean_r x[g, r]``.

    For an Embedding ``(A, B)`` swap roles: the one-hot side is the first factor (``[V, V]``).
    """
    seen = {}
    handles = []
    for name, module in plain.named_modules():
        if isinstance(module, types):

            def hook(m, inputs, output, name=name):
                seen[name] = (m, inputs[0].detach(), output)

            handles.append(module.register_forward_hook(hook))
    try:
        out = plain(X)
    finally:
        for h in handles:
            h.remove()
    sqrt = _hessian_sqrt(loss_on, out.detach(), y)
    result = {}
    for name, (module, x, z) in seen.items():
        cols = [
            torch.autograd.grad(out, z, s.reshape(out.shape), retain_graph=True)[0] for s in sqrt.T
        ]
        v = torch.stack([_output_rows(module, c, bd) for c in cols])  # [K, G, R, out]
        rows = _layer_rows(module, x, bd)  # [G, R, in]
        if approx == "expand":
            b = torch.einsum("kgri,kgrj->ij", v, v)
            a = torch.einsum("gri,grj->ij", rows, rows) / (rows.shape[0] * rows.shape[1])
        else:
            vs = v.sum(2)
            b = torch.einsum("kgi,kgj->ij", vs, vs)
            xm = rows.mean(1)
            a = xm.T @ xm / xm.shape[0]
        result[name] = (b, a)
    return result


def kfra_mlp(plain: nn.Sequential, loss_on, X, y) -> List[torch.Tensor]:
    """``[B_l]`` of Botev et al.'s recursion for ``Linear - act - ... - Linear`` (2-D inputs):
    ``B_L = Σ_n H_n``, ``B_l = (W_{l+1}ᵀ B_{l+1} W_{l+1}) ⊙ mean_n d_n d_nᵀ`` (``d_n`` the
    activation's derivative at sample ``n``)."""
    layers = list(plain)
    pre, h = [], X
    for layer in layers:
        h = layer(h)
        pre.append(h)
    out = h.detach()
    hess = torch.func.hessian(lambda o: loss_on(o, y))(out)
    n = out.shape[0]
    b = sum(hess[i, :, i, :] for i in range(n))
    factors = [b]
    for i in range(len(layers) - 1, 0, -1):
        if isinstance(layers[i], nn.Linear):
            w = layers[i].weight.detach()
            b = w.T @ b @ w
        else:  # elementwise activation applied to pre[i - 1]
            z = pre[i - 1].detach().requires_grad_()
            d = torch.autograd.grad(layers[i](z).sum(), z)[0]
            b = b * (d.T @ d) / n
            factors.insert(0, b)
    return factors
