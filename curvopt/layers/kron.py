"""Kronecker factors of a parameter's GGN block from columns ``V`` propagated to the layer output.

``kron(*factors)`` is indexed like ``p.flatten()``. With per-sample outputs ``V [K, N, *out]``:

* ``Linear`` (``x [N, T, I]``, ``V [K, N, T, O]``): ``[B (O x O), A (I x I)]``;
  "expand": ``B = sum_{k,n,t} v v^T``, ``A = mean_{n,t} x x^T``;
  "reduce": ``B = sum_{k,n} (sum_t v)(sum_t v)^T``, ``A = mean_n xbar xbar^T``, ``xbar = mean_t x``.
* ``Conv{1,2,3}d``: as "expand" with conv locations as positions and ``x`` the unfolded patches
  (KFC, Grosse & Martens 2016); ``groups > 1`` is rejected (no single Kronecker product).
* ``Embedding`` (``W [V, D]``): ``[A (V x V), B (D x D)]`` in the order of ``W``'s dims; the
  factors of a bias-free ``Linear`` on one-hot tokens (padding tokens: zero vectors): "expand"
  ``A = diag(token counts) / (N T)``, "reduce" ``A = mean_n xbar xbar^T`` with ``xbar`` the
  token frequencies of sample ``n``; ``B`` as above.
* A layer registered elsewhere gives its own (:meth:`LayerRule.kron_factors`), e.g. Hugging
  Face's ``Conv1D`` (``layers.transposed_linear``).
* Any one-dimensional parameter (biases, norm scales): ``[B]``, the exact block
  ``sum_{k,n} g_nk g_nk^T`` from the per-(sample, column) gradients.

For ``N = 1`` and one position each factorisation is exact. Every factor built from fewer
rows than its size carries its root (``reductions.gram_root``), for low-rank inversion.
"""

from __future__ import annotations

import torch
from torch import nn

from curvopt.errors import UnsupportedKroneckerError, module_error
from curvopt.layers.registry import reparametrization, rule_for
from curvopt.layers.unfold import unfold_conv_input
from curvopt.reductions import block_gram, gram


def _input_factor(x, approx):
    """``A`` from inputs ``x [N, P, I]``: mean over samples and positions of ``x xᵀ``
    ("expand"), or over samples of ``xbar xbarᵀ`` with ``xbar`` the mean over positions."""
    if approx == "reduce":
        return gram(x.mean(1), 1 / x.shape[0])
    return gram(x.flatten(0, 1), 1 / x.shape[:2].numel())


def linear_like(x, v, approx):
    """``[B, A]`` from inputs ``x [N, P, I]`` and columns ``v [K, N, P, O]``."""
    outputs = v.sum(2).flatten(0, 1) if approx == "reduce" else v.flatten(0, 2)
    return [gram(outputs), _input_factor(x, approx)]


def kron_factors(call, columns, name: str, p: torch.Tensor, approx: str, n: int):
    """Kronecker factors of ``p`` (see module docstring) for one call."""
    module = call.module
    own = rule_for(module).kron_factors(call, columns, name, approx, n)
    if own is not None:
        return own
    if p.dim() == 1:
        rule = rule_for(module)
        grads = rule.batch_grad(call.expand(columns), name)
        return [gram(grads)]
    if isinstance(columns, tuple):
        raise module_error(module, "Kronecker factors need a module with a single output")
    if isinstance(module, nn.Linear) and name == "weight":
        x = call.input.reshape(n, -1, call.input.shape[-1])
        v = columns.reshape(columns.shape[0], n, -1, columns.shape[-1])
        return linear_like(x, v, approx)
    if isinstance(module, nn.modules.conv._ConvNd) and not module.transposed and name == "weight":
        if module.groups != 1:
            reason = (
                f"groups={module.groups}: each group has its own input factor, so the weight's "
                "GGN block is not one Kronecker product; use a diagonal quantity instead, or "
                "skip it with curvopt.collect(..., skip_unsupported=True)"
            )
            raise UnsupportedKroneckerError(str(module_error(module, reason)))
        patches = unfold_conv_input(module, call.input, positions_first=True)  # [N, L, C_in k]
        k = columns.shape[0]
        v = columns.reshape(k * n, columns.shape[2], -1)  # [K N, C_out, L], as laid out
        output_factor = gram(v.sum(2)) if approx == "reduce" else block_gram(v)
        return [output_factor, _input_factor(patches, approx)]
    if isinstance(module, nn.Embedding) and name == "weight":
        idx = call.input.reshape(n, -1)
        dim = columns.shape[-1]
        if approx == "reduce":
            # the lookup is a Linear on one-hot tokens: xbar_n = token frequencies of sample n
            counts = columns.new_zeros(n, module.num_embeddings)
            counts.scatter_add_(1, idx, columns.new_ones(idx.shape))
            if module.padding_idx is not None:
                counts[:, module.padding_idx] = 0
            xbar = counts / idx.shape[1]
            v = columns.reshape(columns.shape[0], n, -1, dim).sum(2)
            return [gram(xbar, 1 / n), gram(v.flatten(0, 1))]
        counts = torch.bincount(idx.flatten(), minlength=module.num_embeddings).to(columns.dtype)
        if module.padding_idx is not None:
            counts[module.padding_idx] = 0
        return [torch.diag(counts / idx.numel()), gram(columns.reshape(-1, dim))]
    how = reparametrization(module)
    if how is not None:
        raise module_error(
            module,
            f"parameter {name!r} is an original of the reparametrized parameter {how}, and the "
            "layer's weight is not linear in it, so its GGN block has no Kronecker factors; "
            "use a diagonal quantity (DiagGGNExact/DiagGGNMC), or remove the parametrization",
        )
    raise UnsupportedKroneckerError(
        f"curvopt has no Kronecker factorisation for parameter {name!r} of module "
        f"{module._curvopt_path!r} ({type(module).__name__}); supported: Linear, Conv1d/2d/3d "
        "(groups=1), Embedding weights, Hugging Face Conv1D and all one-dimensional parameters. "
        "Use a diagonal quantity (DiagGGNExact/DiagGGNMC) for this model, or skip such "
        "parameters explicitly with curvopt.collect(..., skip_unsupported=True) (optim.KFAC: "
        "fallback='diagonal' or 'sgd')"
    )


def output_factor_index(module, name: str) -> int:
    """Position of the output-side factor ``B`` (the one built from the columns) in the list."""
    if isinstance(module, nn.Embedding) and name == "weight":
        return 1
    return rule_for(module).output_factor_index(name)


def nearest_kronecker(terms, input_side: int):
    """Factors ``[F0, F1]`` whose ``kron`` is nearest in Frobenius norm to
    ``sum_i kron(F0_i, F1_i)``: the factors of a weight used by several calls (a reused module,
    a weight tied across modules), each use's cross terms with the others ignored, as KFAC
    ignores them between positions (Van Loan & Pitsianis, 1993).

    Rearranged (``kron(B, A) -> vec(B) vec(A)^T``) the sum is ``U V^T`` with ``U = [vec F0_i]``,
    ``V = [vec F1_i]``, and its best rank-one term comes from the SVD of the ``m x m`` matrix
    ``R_U R_V^T`` of their QR factors. The Gram matrices of PSD factors are entrywise positive,
    so the leading singular vectors are too and both factors are PSD. The scale is split so that
    the factor at ``input_side`` has the mean trace of the uses' factors there. One-dimensional
    parameters (``[B]`` per use) add exactly.
    """
    if len(terms[0]) == 1:
        return [sum(t[0] for t in terms)]
    u = torch.stack([t[0].flatten() for t in terms], 1)
    v = torch.stack([t[1].flatten() for t in terms], 1)
    qu, ru = torch.linalg.qr(u)
    qv, rv = torch.linalg.qr(v)
    left, values, right = torch.linalg.svd(ru @ rv.T)
    f0 = (qu @ left[:, 0]).reshape(terms[0][0].shape)
    f1 = (qv @ right[0]).reshape(terms[0][1].shape)
    if torch.trace(f0) < 0:
        f0, f1 = -f0, -f1
    factors = [f0, f1 * values[0]]
    wanted = sum(torch.trace(t[input_side]) for t in terms) / len(terms)
    ratio = wanted / torch.trace(factors[input_side])
    factors[input_side] = factors[input_side] * ratio
    factors[1 - input_side] = factors[1 - input_side] / ratio
    return factors
