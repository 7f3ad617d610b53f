"""``nn.Embedding``: ``idx [N, *] -> y = W[idx]  [N, *, D]``.

With ``g_nt = dL/dy_nt``: ``g_n(W)[v] = sum_{t: idx_nt = v} g_nt``. Rows are aggregated per
distinct (sample, token) pair ``a_nv``, so that ``||g_n||^2 = sum_v ||a_nv||^2`` and
``sum_n g_n**2 = sum_n a_nv**2`` cost ``O(N T D)`` instead of ``O(N V D)``.

Kronecker factors ``[A (V x V), B (D x D)]``, in the order of ``W``'s dims: those of a
bias-free ``Linear`` on one-hot tokens (padding tokens: zero vectors), "expand"
``A = diag(token counts) / (N T)``, "reduce" ``A = mean_n xbar xbar^T`` with ``xbar`` the token
frequencies of sample ``n``; ``B`` as for ``Linear`` (``layers.kron``). ``EKFAC``'s moment
from the one-hot tokens and the gradients as a ``Linear``'s operands (``layers.eigenbasis``).
"""

from __future__ import annotations

import torch
from torch import nn

from curvopt.layers.eigenbasis import eigen_moment
from curvopt.layers.registry import LayerRule, moment_in_chunks, register
from curvopt.core.reductions import gram


def _rows(call):
    """Flat token ids ``[N T]``, their sample index ``[N T]`` and gradients ``[N T, D]``."""
    idx, g = call.input, call.grad_out
    n, dim = g.shape[0], g.shape[-1]
    idx = idx.reshape(n, -1)
    samples = torch.arange(n, device=idx.device).repeat_interleave(idx.shape[1])
    idx, g = idx.reshape(-1), g.reshape(-1, dim)
    padding_idx = call.module.padding_idx
    if padding_idx is not None:
        g = g * (idx != padding_idx).unsqueeze(1).to(g.dtype)
    return idx, samples, g


def _aggregate(call):
    """``a [U, D]``: gradient rows summed per distinct (sample, token); its sample and token."""
    idx, samples, g = _rows(call)
    vocab = call.module.num_embeddings
    keys, inverse = torch.unique(samples * vocab + idx, return_inverse=True)
    agg = torch.zeros(keys.numel(), g.shape[1], dtype=g.dtype, device=g.device)
    agg.index_add_(0, inverse, g)
    return agg, keys // vocab, keys % vocab


@register(nn.Embedding)
class EmbeddingRule(LayerRule):
    positionwise = True
    curvature_free = True

    def check(self, module):
        if module.scale_grad_by_freq:
            return (
                "scale_grad_by_freq=True scales gradients by batch-wide token counts, so "
                "per-sample gradients are not defined. Construct the Embedding without it."
            )
        return None

    def batch_grad(self, call, name, out=None):
        idx, samples, g = _rows(call)
        n, vocab = call.grad_out.shape[0], call.module.num_embeddings
        if out is None:
            out = torch.empty(n, vocab, g.shape[1], dtype=g.dtype, device=g.device)
        out.zero_()
        out.view(n * vocab, -1).index_add_(0, samples * vocab + idx, g)
        return out

    def batch_l2(self, call, name):
        agg, samples, _ = _aggregate(call)
        n = call.grad_out.shape[0]
        result = torch.zeros(n, dtype=agg.dtype, device=agg.device)
        return result.index_add_(0, samples, agg.pow(2).sum(1))

    def sum_grad_squared(self, call, name):
        agg, _, tokens = _aggregate(call)
        result = torch.zeros_like(call.module.weight, dtype=agg.dtype)
        return result.index_add_(0, tokens, agg.pow(2))

    def grad_sum(self, call, name):
        idx, _, g = _rows(call)
        result = torch.zeros_like(call.module.weight, dtype=g.dtype)
        return result.index_add_(0, idx, g)

    def projected_sum(self, call, name, u, v):
        """``sum_r u[token_r] ⊙ (g_rᵀ v)``: a token's one-hot input picks its row of ``u``
        (and has norm 1)."""
        idx, _, g = _rows(call)
        projected = (u.to(g.dtype)[idx] * (g @ v.to(g.dtype))).sum(0)
        return projected, torch.linalg.vector_norm(g, dim=1).sum()

    def kron_output_factor(self, call, columns, name, approx, n):
        dim = columns.shape[-1]
        if approx == "reduce":
            return gram(columns.reshape(columns.shape[0], n, -1, dim).sum(2).flatten(0, 1))
        return gram(columns.reshape(-1, dim))

    def kron_input_factor(self, call, name, approx, n):
        module = call.module
        weight, idx = module.weight, call.input.reshape(n, -1)
        if approx == "reduce":
            # the lookup is a Linear on one-hot tokens: xbar_n = token frequencies of sample n
            counts = weight.new_zeros(n, module.num_embeddings)
            counts.scatter_add_(1, idx, weight.new_ones(idx.shape))
            if module.padding_idx is not None:
                counts[:, module.padding_idx] = 0
            return gram(counts / idx.shape[1], 1 / n)
        counts = torch.bincount(idx.flatten(), minlength=module.num_embeddings).to(weight.dtype)
        if module.padding_idx is not None:
            counts[module.padding_idx] = 0
        return torch.diag(counts / idx.numel())

    def eigen_correction(self, call, name, bases):
        """``Σ_n (Q_Aᵀ onehot_nᵀ g_n Q_B)²`` from the one-hot tokens and the gradients
        (:meth:`gradient_rows`, ``[N, T, V]`` and ``[N, T, D]``) where both sides have a basis:
        ``eigen_moment`` rotates them (``T (V² + D²)`` flops a sample where they are fewer than
        the ``V D (V + D)`` of a rotated per-sample gradient ``[V, D]``), over chunks of
        samples whose one-hot tokens hold at most ``CHUNK_ELEMENTS`` (a vocabulary far wider
        than the embedding)."""
        if len(bases) != 2:
            return super().eigen_correction(call, name, bases)

        def moment(part):
            onehot, g = self.gradient_rows(part, name)
            n = part.grad_out.shape[0]
            onehot, g = onehot.reshape(n, -1, onehot.shape[-1]), g.reshape(n, -1, g.shape[-1])
            return eigen_moment(onehot, g, bases)

        positions = call.input.numel() // call.batch_size
        return moment_in_chunks(call, positions * call.module.num_embeddings, moment)

    def gradient_rows(self, call, name):
        """``G = onehot(idx)ᵀ g``: ``(one-hot tokens [R, V], gradients [R, D])``, padding
        rows zero."""
        idx, _, g = _rows(call)
        onehot = torch.zeros(
            idx.numel(), call.module.num_embeddings, dtype=g.dtype, device=g.device
        )
        return onehot.scatter_(1, idx.unsqueeze(1), 1.0), g

    def output_factor_index(self, name):
        return 1
