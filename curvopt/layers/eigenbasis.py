"""Eigen-corrected curvature (``EKFAC``, George et al. 2018) on the canonical weight-sharing
format of ``layers.kron``: second moments of per-sample gradients in a Kronecker eigenbasis.

In a basis ``bases = [Q_0, Q_1]`` (``[Q_0]``, ``[]``: a missing factor is the identity) the
moment is ``Σ_n (Q_0ᵀ G_n Q_1)²`` with ``G_n`` the per-sample gradient as a ``[dim Q_0, ·]``
matrix (:func:`as_rows`). On the canonical format, ``G_n = b_nᵀ a_n`` for output gradients
``b [N, P, O]`` and inputs ``a [N, P, I]``, so :func:`eigen_moment` rotates ``a`` and ``b``
instead of ``G_n`` where that is cheaper (``P (O² + I²) ≤ O I (O + I)``): ``Σ_n (b̃_nᵀ ã_n)²``
with ``ã = a Q_1``, ``b̃ = b Q_0``, which for ``P = 1`` is ``(b̃²)ᵀ (ã²)`` (no per-sample
gradient formed); with many positions (a convolution whose locations outnumber its channels)
it forms ``G_n`` chunk by chunk and rotates it. :func:`eigen_moment_of` is the same from
materialised per-sample gradients (the default of ``LayerRule.eigen_correction``);
:func:`eigen_moment_of_vectors` that of a one-dimensional parameter (a bias, a norm's weight)
shared over positions, by one product for the batch.
"""

from __future__ import annotations

import torch

#: elements of per-sample (rotated) gradients held at once
CHUNK_ELEMENTS = 1 << 21


def as_rows(tensor: torch.Tensor, bases, leading: int = 0) -> torch.Tensor:
    """``tensor`` (``[*lead, *p.shape]``, ``leading`` leading dims) as ``[*lead, dim Q_0, ·]``
    matrices (``[*lead, 1, numel]`` without a basis; ``[*lead, G, dim Q_0, ·]`` for the
    stacked bases ``[G, d, d]`` of a grouped convolution, its rows in groups)."""
    rows = bases[0].shape[:-1] if bases else (1,)
    return tensor.reshape(*tensor.shape[:leading], *rows, -1)


def rotate(bases, matrix: torch.Tensor, back: bool = False, transposed=None) -> torch.Tensor:
    """``Q_0ᵀ M Q_1`` into the eigenbasis (``back``: ``Q_0 M Q_1ᵀ`` out of it), for ``M`` of
    shape ``[..., dim Q_0, dim Q_1]``; a missing factor is the identity. In ``bases``' dtype.
    ``transposed``: the views ``[Q.mT for Q in bases]`` where the caller keeps them (a solve
    applied at every step: the same views, so the same products, without forming them again).

    With leading dims the left product is taken as ``(Mᵀ Q_0)ᵀ``: one matrix product over all
    of them (``Q_0ᵀ @ M`` would broadcast ``Q_0`` into one small product per leading index)."""
    if bases:
        first = bases[0]
        if matrix.dtype != first.dtype:
            matrix = matrix.to(first.dtype)
        if matrix.dim() > 2:
            matrix = (matrix.mT @ (first.mT if back else first)).mT
        elif back:
            matrix = first @ matrix
        else:
            matrix = (first.mT if transposed is None else transposed[0]) @ matrix
    if len(bases) == 2:
        if back:
            matrix = matrix @ (bases[1].mT if transposed is None else transposed[1])
        else:
            matrix = matrix @ bases[1]
    return matrix


def eigen_moment_of(grads: torch.Tensor, bases) -> torch.Tensor:
    """``Σ_n (Q_0ᵀ G_n Q_1)²`` from per-sample gradients ``grads [N, *p.shape]``
    (``N (dim Q_0² dim Q_1 + dim Q_0 dim Q_1²)`` flops, a rotated copy of ``grads``)."""
    rotated = rotate(bases, as_rows(grads, bases, leading=1))
    squared = rotated.square_() if bases else rotated.square()  # in place: a fresh product
    return squared.sum(0)


def eigen_moment_of_vectors(grads: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """``Σ_n (Q_0ᵀ g_n)²`` (``[d, 1]``, the rows of :func:`as_rows`) of a one-dimensional
    parameter's per-sample gradients ``grads [N, d]`` in ``basis = Q_0 [d, d]``: one product
    ``grads Q_0`` for the batch (``N d²`` flops), where :func:`eigen_moment_of` rotates sample
    by sample, ``N`` vector-matrix products of the same flops taking 3-4 times as long
    (``[32, 512]`` by ``512 × 512``: 0.16 ms against 0.52, one thread). The two round
    differently: the rules take this product only for parameters shared over positions (a
    bias or norm weight of a sequence or an image), leaving the layers without positions (and
    their recorded steps) the per-sample route."""
    rotated = grads.to(basis.dtype) @ basis
    return rotated.square_().sum(0).unsqueeze(-1)  # in place: a fresh product


def eigen_moment(left: torch.Tensor, right: torch.Tensor, bases) -> torch.Tensor:
    """``Σ_n (Q_0ᵀ left_nᵀ right_n Q_1)²`` for ``left [N, P, d_0]`` and ``right [N, P, d_1]``
    with ``G_n = left_nᵀ right_n`` (``Linear``: output gradients and inputs; Hugging Face's
    ``Conv1D``: inputs and output gradients), ``bases = [Q_0, Q_1]``.

    Per sample, rotating the operands costs ``P (d_0² + d_1²)`` flops and rotating ``G_n``
    ``d_0 d_1 (d_0 + d_1)``; the cheaper is taken. Rotated operands and ``P = 1`` (a dense layer
    without sharing): ``(left Q_0)²ᵀ (right Q_1)²``, no per-sample gradient formed. Otherwise
    the per-sample gradients (in the eigenbasis when the operands were rotated) are formed by
    batched products over chunks of samples (``P d_0 d_1`` flops each, ``CHUNK_ELEMENTS`` at
    once), never all of ``[N, d_0, d_1]``."""
    q0, q1 = bases
    d0, d1, positions = q0.shape[0], q1.shape[0], left.shape[1]
    operands = positions * (d0 * d0 + d1 * d1) <= d0 * d1 * (d0 + d1)
    if operands:
        left, right = left.to(q0.dtype) @ q0, right.to(q1.dtype) @ q1
        if positions == 1:
            return left[:, 0].square().T @ right[:, 0].square()
    n = left.shape[0]
    step = max(1, CHUNK_ELEMENTS // (d0 * d1))
    total = None
    for start in range(0, n, step):
        chunk = torch.bmm(left[start : start + step].mT, right[start : start + step])
        if not operands:
            chunk = rotate(bases, chunk)
        chunk = chunk.square_().sum(0)
        total = chunk if total is None else total.add_(chunk)
    return total
