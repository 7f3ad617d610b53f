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
sides (``S`` then the diagonal of the empirical Fisher). With
``EKFAC(basis_source="last_refresh")``, the default, every parameter runs on this schedule
(``max_dim=None``: no side is wide): the bases of a window's passes are known before the
first of them, so its micro-batches' ``S`` add up to one batch's. Functions here are pure.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from curvopt.core.psd import psd_eigh, working_dtype
from curvopt.inversion.warm_eigh import warm_eigenbasis

#: per side the basis to supply at the next pass: an eigenbasis, or None (the identity)
Pending = Sequence[torch.Tensor | None]


def sides(param: torch.Tensor) -> list[int]:
    """``[rows, columns]`` of ``param`` as ``[p.shape[0], -1]`` (``[p.shape[0]]`` if 1-D)."""
    rows = param.shape[0]
    return [rows] if param.dim() == 1 else [rows, param.numel() // rows]


def is_wider(dim: int, max_dim: int | None) -> bool:
    """Whether a side of ``dim`` keeps the identity basis under ``max_dim`` (None: none does)."""
    return max_dim is not None and dim > max_dim


def is_one_sided(param: torch.Tensor, max_dim: int | None) -> bool:
    """Whether a side of ``param`` is wider than ``max_dim`` (None: none is)."""
    return param.dim() > 0 and any(is_wider(d, max_dim) for d in sides(param))


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


def next_bases(
    factors: Sequence[torch.Tensor],
    max_dim: int | None,
    previous: Pending | None = None,
    found: Refresh | None = None,
    powers: Pending | None = None,
) -> list[torch.Tensor | None]:
    """Per side the eigenvectors of its factor (:func:`settled_eigenvectors`), None where
    wider than ``max_dim`` (that factor is not decomposed; ``None``: every side is; factors
    stacked per group: where each group's is); a side with a ``previous`` basis (the last
    refresh's, ``basis_refresh="warm"``) refreshed from it by one power step and a QR
    (:func:`~curvopt.inversion.warm_eigh.warm_eigenbasis`; its power step ``F Q`` taken from
    ``powers`` where given, :func:`~curvopt.inversion.warm_eigh.power_step`); a side whose
    factor and previous basis equal those of a side decomposed before in ``found`` (one
    refresh's) takes that side's basis (:class:`Refresh`)."""
    previous = [None] * len(factors) if previous is None else previous
    powers = [None] * len(factors) if powers is None else powers
    found = Refresh() if found is None else found
    return [
        None if is_wider(f.shape[-1], max_dim) else found.basis(f, q, y)
        for f, q, y in zip(factors, previous, powers)
    ]


class Refresh:
    """The bases decomposed at one refresh, so that a factor equal to one decomposed before,
    from an equal previous basis (or none), is not decomposed again: a layer's bias has its
    weight's output-side factor (``[B]`` and ``[B, A]``, equal entries), so its basis is the
    weight's, the same bits a second decomposition of the same matrix gives. A factor is
    compared (``torch.equal``) only with those of its shape, dtype and trace (one host read)."""

    def __init__(self):
        self._found: dict[tuple, list[tuple]] = {}

    def basis(
        self,
        factor: torch.Tensor,
        previous: torch.Tensor | None,
        power: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``factor``'s next basis (:func:`_next_basis`, from the power step ``power`` where
        formed already), or the equal one found before."""
        if not isinstance(factor, torch.Tensor):  # (a Gram root's form: decomposed alone)
            return _next_basis(factor, previous, power)
        trace = float(factor.diagonal(dim1=-2, dim2=-1).sum())
        key = (factor.shape, factor.dtype, factor.device, trace)
        candidates = self._found.setdefault(key, [])
        for earlier, earlier_previous, basis in candidates:
            if torch.equal(earlier, factor) and _equal(earlier_previous, previous):
                return basis
        basis = _next_basis(factor, previous, power)
        candidates.append((factor, previous, basis))
        return basis


def _equal(first: torch.Tensor | None, second: torch.Tensor | None) -> bool:
    """Whether two previous bases are both absent, or of one shape and dtype with equal
    entries."""
    if first is None or second is None:
        return first is second
    same = first.shape == second.shape and first.dtype == second.dtype
    return same and torch.equal(first, second)


def _next_basis(
    factor: torch.Tensor, previous: torch.Tensor | None, power: torch.Tensor | None = None
) -> torch.Tensor:
    """One side's next basis: exact (:func:`settled_eigenvectors`) or warm from ``previous``
    (with its power step ``power = F Q`` where formed already), its columns ordered by the
    power step's norms ``|diag R|`` (ascending, as ``eigh``'s) and those at rounding level, the
    null space, settled in the same way."""
    if previous is None:
        return settled_eigenvectors(factor)
    norms, basis = warm_eigenbasis(factor, previous, power)
    norms, order = norms.sort(dim=-1, stable=True)
    return _settled_all(norms, basis.gather(-1, order.unsqueeze(-2).expand_as(basis)))


def settled_eigenvectors(factor: torch.Tensor) -> torch.Tensor:
    """The eigenvectors ``Q`` of a PSD factor ``F`` (``psd_eigh``), those of its null space
    chosen by the space alone.

    ``eigh`` returns any orthonormal basis ``N [d, k]`` of the null space (eigenvalues within
    ``d ε s_max`` of 0), set by rounding: a factor summed over micro-batches and the same
    factor of one batch, equal to rounding, get bases turned against each other there. Unlike
    the current batch's gradients, the next steps' have components in that space, so ``S``
    (the diagonal in the basis) would differ. Here the null space of ``k`` columns gets a basis
    set by the factor alone, by whichever of two constructions is cheaper:

    - ``k ≤ d − k``: ``N`` is replaced by ``N V``, ``V`` the eigenvectors of ``Nᵀ D N`` with
      ``D = diag(√1, …, √d)``: the same for every basis of the space (up to signs, which ``S``
      and the step do not see) wherever those eigenvalues are distinct (an ``eigh`` of
      ``k × k`` and two ``d × k × k`` products);
    - ``k > d − k`` (a factor of few samples, as a bias's ``Σ_n g_n g_nᵀ`` of ``N < d``
      samples): ``N`` is replaced by the last ``k`` columns of the orthogonal factor ``H`` of
      the Householder QR of the other eigenvectors ``R [d, d − k]`` (ascending), ``R = H
      [T; 0]``: the orthogonal complement of their span, a function of those eigenvectors,
      which are the factor's alone where their eigenvalues are distinct, and not of their
      signs (a reflector does not see its vector's). ``H`` is ``d − k`` reflectors
      (``4 d² (d − k)`` flops): on the character GPT's ``[512, 512]`` bias factor of rank 32,
      3 ms where the ``eigh`` of the ``480 × 480`` null block and its products take 19 ms.

    Factors stacked per group (``[G, d, d]``) are settled group by group.

    Args:
        factor: a symmetric PSD ``[d, d]`` matrix, or ``[G, d, d]`` of them.

    Returns:
        ``Q`` of the factor's shape, orthogonal, ``F = Q diag(s) Qᵀ`` with ``s`` ascending.
    """
    return _settled_all(*psd_eigh(factor))


def _settled_all(eigenvalues: torch.Tensor, vectors: torch.Tensor) -> torch.Tensor:
    """:func:`_settled` of one factor's eigenpairs, or of each group's (``[G, d, d]``)."""
    if vectors.dim() > 2:
        return torch.stack([_settled(s, q) for s, q in zip(eigenvalues, vectors)])
    return _settled(eigenvalues, vectors)


def _settled(eigenvalues: torch.Tensor, vectors: torch.Tensor) -> torch.Tensor:
    """``vectors`` with the null space's columns turned as :func:`settled_eigenvectors` says."""
    dim = eigenvalues.shape[0]
    floor = dim * torch.finfo(eigenvalues.dtype).eps * eigenvalues[-1]
    nullity = int((eigenvalues <= floor).sum())
    if nullity < 2:
        return vectors
    if nullity > dim - nullity:
        return torch.cat([_complement(vectors[:, nullity:]), vectors[:, nullity:]], dim=1)
    null = vectors[:, :nullity]
    weights = torch.arange(1, dim + 1, dtype=null.dtype, device=null.device).sqrt()
    turn = torch.linalg.eigh(null.mT @ (weights[:, None] * null))[1]
    return torch.cat([null @ turn, vectors[:, nullity:]], dim=1)


def _complement(vectors: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis ``[d, d − r]`` of the orthogonal complement of the orthonormal
    columns ``vectors [d, r]``: the last ``d − r`` columns of the orthogonal factor of their
    Householder QR, the product of its ``r`` reflectors, which depend on the columns but not
    on their signs (the identity for ``r = 0``)."""
    dim, rank = vectors.shape
    reflectors, scales = torch.geqrf(vectors)
    square = torch.nn.functional.pad(reflectors, (0, dim - rank))
    return torch.linalg.householder_product(square, scales)[:, rank:]
