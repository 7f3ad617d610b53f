"""The math of ``python -m experiments compare``: exact curvature blocks and how well an
approximation matches them.

Blocks are taken on a coordinate subset ``S`` of each parameter (:func:`select`): the
parameter as the matrix ``[d0, d1]`` (``d0 = shape[0]``, as Kronecker factors index it), rows
``R`` times columns ``C``, flattened row-major, so that the ``S``-block of ``B ⊗ A`` is
``B[R, R] ⊗ A[C, C]`` and the ``S``-block of ``diag(c)`` is ``diag(c[S])`` (EKFAC's
``Q diag(S) Qᵀ``: :func:`eigen_block`).

:func:`exact_blocks` computes, from per-sample Jacobians ``J_n = ∂f_n/∂θ_S`` (``f_n`` the
model output of sample ``n``, ``vmap`` over single-sample ``jacrev``) and the loss Hessian
w.r.t. the whole output ``H_n = ∂²L/∂f_n²`` (the loss is a sum over samples):

* ``G_S = Σ_n J_nᵀ H_n J_n`` (exact GGN block),
* ``EF_S = s Σ_n g_n g_nᵀ`` with ``g_n = J_nᵀ ∂L/∂f_n`` and ``s = N`` for "mean", 1 for "sum"
  (the empirical Fisher of ``curvopt.linalg``), and ``g_S = Σ_n g_n`` (the gradient).

:func:`reference` prepares ``G`` once per block, :func:`block_metrics` compares an
approximation ``C`` with it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from scipy.sparse.linalg import aslinearoperator
from torch import nn
from torch.func import functional_call, grad, jacrev, jvp, vmap

from curvopt.linalg import top_eigenpairs

#: blocks larger than this get their top eigenpairs by Lanczos instead of a full ``eigh``
DENSE_EIGH = 3000


@dataclass(frozen=True)
class Selection:
    """Coordinates ``S`` of one parameter: ``rows`` of ``d0``, ``cols`` of ``d1``."""

    name: str
    shape: tuple[int, ...]
    rows: torch.Tensor
    cols: torch.Tensor

    @property
    def d1(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def flat(self) -> torch.Tensor:
        """Indices of ``S`` in ``vec(p)``, rows outer, columns inner."""
        return (self.rows[:, None] * self.d1 + self.cols[None, :]).flatten()

    @property
    def size(self) -> int:
        return len(self.rows) * len(self.cols)


def select(name: str, shape: Sequence[int], max_block: int, gen: torch.Generator) -> Selection:
    """All of ``p`` if it has at most ``max_block`` entries (or ``max_block == 0``), else random
    sorted rows ``R`` (at most ``√max_block``, more if the columns are few) and columns ``C``
    with ``|R| |C| <= max_block``."""
    d0, d1 = shape[0], math.prod(shape[1:])
    if max_block == 0 or d0 * d1 <= max_block:
        return Selection(name, tuple(shape), torch.arange(d0), torch.arange(d1))
    rows = min(d0, max(1, math.isqrt(max_block)))
    cols = min(d1, max_block // rows)
    rows = min(d0, max_block // cols)

    def subset(size, k):
        return torch.randperm(size, generator=gen)[:k].sort().values

    return Selection(name, tuple(shape), subset(d0, rows), subset(d1, cols))


def kron_block(factors: Sequence[torch.Tensor], sel: Selection) -> torch.Tensor:
    """``S``-block of ``kron(*factors)``: ``B[R,R] ⊗ A[C,C]`` (``B[R,R]`` for ``[B]``)."""
    out = factors[0][sel.rows][:, sel.rows]
    if len(factors) == 2:
        out = torch.kron(out, factors[1][sel.cols][:, sel.cols])
    return out


def eigen_block(bases: Sequence[torch.Tensor], correction: torch.Tensor, sel: Selection):
    """``S``-block of ``Q diag(vec S) Qᵀ``, ``Q = Q_B ⊗ Q_A`` (``Q_B`` for ``[Q_B]``): entry
    ``((r, c), (r', c'))`` is ``Σ_ij Q_B[r,i] Q_B[r',i] S[i,j] Q_A[c,j] Q_A[c',j]``."""
    left = bases[0][sel.rows]
    if len(bases) == 1:
        return left @ torch.diag(correction[:, 0]) @ left.T
    right = bases[1][sel.cols]
    inner = torch.einsum("cj,ij,dj->icd", right, correction, right)
    block = torch.einsum("ri,si,icd->rcsd", left, left, inner)
    return block.reshape(sel.size, sel.size)


def exact_blocks(
    model: nn.Module,
    loss_on: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    selections: Sequence[Selection],
    mean: bool,
    chunk: int = 16,
) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``{name: (G_S, EF_S, g_S)}`` on all of ``inputs`` as one batch (see module doc)."""
    base = {n: p.detach() for n, p in model.named_parameters()}
    index = {s.name: s.flat.to(inputs.device) for s in selections}

    def forward(deltas, x):
        params = dict(base)
        for name, delta in deltas.items():
            p = base[name]
            params[name] = p.flatten().index_add(0, index[name], delta).view_as(p)
        return functional_call(model, params, (x[None],))[0]

    zeros = {s.name: base[s.name].new_zeros(s.size) for s in selections}
    output = functional_call(model, base, (inputs,)).detach()
    loss = lambda out: loss_on(out, targets)  # noqa: E731
    gradient = grad(loss)(output)
    width = output[0].numel()
    basis = torch.eye(width, dtype=output.dtype, device=output.device)
    directions = basis.reshape(width, 1, *output.shape[1:]).expand(width, *output.shape)
    hvp = vmap(lambda u: jvp(grad(loss), (output,), (u,))[1])(directions)  # [j, N, *F]
    hessians = hvp.flatten(2).permute(1, 2, 0)  # [N, F, F]: column j of each H_n
    cotangents = gradient.flatten(1)  # [N, F]
    scale = len(output) if mean else 1
    sums = {s.name: [0.0, 0.0, 0.0] for s in selections}
    for start in range(0, len(inputs), chunk):
        x = inputs[start : start + chunk]
        jac = vmap(jacrev(forward), in_dims=(None, 0))(zeros, x)  # {name: [n, *F, |S|]}
        h = hessians[start : start + chunk]
        c = cotangents[start : start + chunk]
        for name, j in jac.items():
            j = j.flatten(1, -2)  # [n, F, |S|]
            per_sample = torch.einsum("nf,nfs->ns", c, j)
            acc = sums[name]
            acc[0] = acc[0] + torch.einsum("nfs,nfg,ngt->st", j, h, j)
            acc[1] = acc[1] + scale * per_sample.T @ per_sample
            acc[2] = acc[2] + per_sample.sum(0)
    return {name: tuple(acc) for name, acc in sums.items()}


def _top(matrix: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top ``k`` eigenpairs of a symmetric matrix, largest first."""
    dense = matrix.detach().cpu().double().numpy()
    if len(dense) <= DENSE_EIGH:
        values, vectors = np.linalg.eigh(dense)
        return values[::-1][:k], vectors[:, ::-1][:, :k]
    return top_eigenpairs(aslinearoperator(dense), k=k)


@dataclass(frozen=True)
class Reference:
    """The exact block ``G`` with what every comparison needs: its top-``k`` eigenpairs and
    the damped Newton direction ``d_G = −(G + λI)⁻¹ g`` with its predicted decrease."""

    ggn: torch.Tensor
    gradient: torch.Tensor
    damping: float
    values: np.ndarray
    vectors: np.ndarray
    direction: torch.Tensor
    decrease: float

    def model_decrease(self, direction: torch.Tensor) -> float:
        """``−(gᵀd + ½ dᵀ G d)``: the decrease the exact quadratic model predicts for ``d``."""
        g, d = self.gradient, direction
        return float(-(g @ d + 0.5 * d @ self.ggn @ d))


def _newton(matrix: torch.Tensor, gradient: torch.Tensor, damping: float) -> torch.Tensor:
    eye = torch.eye(len(matrix), dtype=matrix.dtype, device=matrix.device)
    return -torch.linalg.solve(matrix + damping * eye, gradient)


def reference(ggn: torch.Tensor, gradient: torch.Tensor, damping: float, k: int) -> Reference:
    G, g = ggn.detach().double(), gradient.detach().double()
    values, vectors = _top(G, k)
    direction = _newton(G, g, damping)
    ref = Reference(G, g, damping, values, vectors, direction, 0.0)
    return Reference(G, g, damping, values, vectors, direction, ref.model_decrease(direction))


def block_metrics(ref: Reference, approx: torch.Tensor) -> dict:
    """How well ``C = approx`` stands in for ``G`` on one block.

    * ``rel_frobenius``: ``‖C − G‖_F / ‖G‖_F``;
    * ``overlap``: ``‖U_Gᵀ U_C‖_F² / k`` for the top-``k`` eigenvectors (1: same subspace);
    * ``cosine``: between the damped Newton directions ``d_C = −(C + λI)⁻¹ g`` and ``d_G``;
    * ``decrease``: ``−(gᵀd_C + ½ d_Cᵀ G d_C)``, what the exact quadratic model predicts for
      ``d_C``, and ``decrease_ratio``, that over the decrease predicted for ``d_G``;
    * ``top_eigenvalues``: the ``k`` largest eigenvalues of ``C``.
    """
    C = approx.detach().double()
    k = len(ref.values)
    values, vectors = _top(C, k)
    d_c, d_g = _newton(C, ref.gradient, ref.damping), ref.direction
    decrease = ref.model_decrease(d_c)
    return {
        "rel_frobenius": float(torch.linalg.norm(C - ref.ggn) / torch.linalg.norm(ref.ggn)),
        "overlap": float(np.sum((ref.vectors.T @ vectors) ** 2) / k),
        "cosine": float(d_c @ d_g / (torch.linalg.norm(d_c) * torch.linalg.norm(d_g))),
        "decrease": decrease,
        "decrease_ratio": decrease / ref.decrease if ref.decrease > 0 else None,
        "top_eigenvalues": [float(v) for v in values],
    }
