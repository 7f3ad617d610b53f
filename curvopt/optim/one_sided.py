"""One-sided eigenbases for ``EKFAC(max_basis_dim=m)``: a side of a parameter wider than ``m``
keeps the identity basis (SOAP's one-sided preconditioning of large dimensions).

A parameter's sides are its rows and columns as the matrix ``G = p.reshape(p.shape[0], -1)``
(``[p.shape[0]]`` for a 1-D one), in the order of its factors ``p.kfac`` / ``p.kflr``. With a
basis ``Q_i`` on each side narrower than ``m`` (the eigenvectors of that side's factor) and
``I`` on the wider ones, the curvature is ``Q diag(vec S) Qᵀ`` with ``Q = Q_0 ⊗ Q_1``, and
``S = c Σ_n (Q_0ᵀ G_n Q_1)²``: exactly the diagonal of the empirical Fisher in that basis, as
for two-sided EKFAC. What it gives up is the rotation of the wide side: on FMNIST 2C2D's fc1
(``3136 → 1024``, ``m = 1024``) ``S`` is diagonal over the 3136 inputs, as Adam's is, and the
3136² input factor is never eigendecomposed, and the step skips three
quarters of its dense rotations (``1024 / (1024 + 3136)`` of them are left). The pass that
computes ``S`` is handed the identity as a tensor (the engine's fast moment of a dense layer
takes two bases), so it still multiplies the inputs by it (``N d²`` flops).

The basis is found from the factors of a basis step and used from the next step on (the
supplied basis of a pass must be known before it); the first step uses the identity on both
sides (``S`` then the diagonal of the empirical Fisher). Functions here are pure.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from curvopt.core.psd import psd_eigh, working_dtype

#: per side the basis to supply at the next pass: an eigenbasis, or None (the identity)
Pending = Sequence[torch.Tensor | None]


def sides(param: torch.Tensor) -> list[int]:
    """``[rows, columns]`` of ``param`` as ``[p.shape[0], -1]`` (``[p.shape[0]]`` if 1-D)."""
    rows = param.shape[0]
    return [rows] if param.dim() == 1 else [rows, param.numel() // rows]


def is_one_sided(param: torch.Tensor, max_dim: int | None) -> bool:
    """Whether a side of ``param`` is wider than ``max_dim`` (None: none is)."""
    return max_dim is not None and param.dim() > 0 and any(d > max_dim for d in sides(param))


def supplied(param: torch.Tensor, pending: Pending | None) -> list[torch.Tensor]:
    """The bases to supply for ``param``'s next pass: ``pending``'s with the identity for its
    ``None`` sides, the identity on every side before there is any (the first step); beside
    bases stacked per group (``[G, d, d]``, a grouped convolution's), each group's identity."""
    dtype = working_dtype(param.dtype)
    pending = [None] * len(sides(param)) if pending is None else pending
    groups = next((len(q) for q in pending if q is not None and q.dim() == 3), None)
    sizes = sides(param) if groups is None else [param.shape[0] // groups, *sides(param)[1:]]

    def identity(d):
        eye = torch.eye(d, dtype=dtype, device=param.device)
        return eye if groups is None else eye.expand(groups, d, d).clone()

    return [identity(d) if q is None else q for d, q in zip(sizes, pending)]


def kept(curvature: Sequence[torch.Tensor], pending: Pending | None) -> list[torch.Tensor]:
    """``[S, *bases]`` read in the :func:`supplied` bases, with identity sides that trail
    dropped (an identity before a kept basis stays: bases are positional) and ``S`` shaped as
    the rows the kept bases rotate (``[1, numel]`` for none)."""
    correction, bases = curvature[0], list(curvature[1:])
    identity = [True] * len(bases) if pending is None else [q is None for q in pending]
    while bases and identity[len(bases) - 1]:
        bases.pop()
    rows = bases[0].shape[:-1] if bases else (1,)
    return [correction.reshape(*rows, -1), *bases]


def next_bases(factors: Sequence[torch.Tensor], max_dim: int) -> list[torch.Tensor | None]:
    """Per side the eigenvectors of its factor (``psd_eigh``), None where wider than
    ``max_dim`` (that factor is not decomposed; factors stacked per group: where each group's
    is)."""
    return [None if f.shape[-1] > max_dim else psd_eigh(f)[1] for f in factors]
