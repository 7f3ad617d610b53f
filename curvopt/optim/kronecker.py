"""The damped inverse of a Kronecker block ``C = B ⊗ A``, :class:`KroneckerInverse` (the
``DampedInverse`` that ``KFAC`` and ``curvopt.linalg`` apply), in one file: how it is built
(:class:`InverseOptions`), the trace-norm damping and its solves.

Factors come as a list in the API order: ``[B, A]`` for a weight of shape ``[out, in, *k]``
(``B``: ``[out, out]``, output side; ``A``: ``[in·k, in·k]``, input side) or ``[B]`` for a bias.
A gradient is handled as the matrix ``G = grad.reshape(out, -1)`` of shape ``[out, in·k]``
(``[out, 1]`` for a bias), so that with row-major ``vec`` ``(B ⊗ A) vec(G) = vec(B G Aᵀ)``,
and ``B ⊗ A`` is never formed. Three ways to damp by ``λ``:

* trace-norm (:func:`trace_norm_inverse`): ``(B + √λ/π I)⁻¹ ⊗ (A + π√λ I)⁻¹`` with
  ``π = sqrt((tr A / dim A) / (tr B / dim B))`` (Martens & Grosse 2015, Sec. 6.3: each factor
  is damped in proportion to its own scale, the input side ``A`` gets ``π√λ``); what the
  optimizer applies: per damped factor (``optim.factor_inverse``) its Cholesky factor solved
  by triangular solves (:func:`trace_norm_cholesky` + :func:`kron_cholesky_solve`), or, when
  it is reused, its inverse applied by matrix products (:func:`trace_norm_solvers` +
  :func:`kron_solve`, twice as fast); a factor ``F = UᵀU`` with a root of ``r < d`` rows (a
  batch smaller than the layer's width, see ``reductions.gram_root``) is inverted by Woodbury
  instead (:class:`LowRankInverse`);
* the same split in the factors' eigenbases (``optim.trace_norm_eigh``);
* exact (``optim.kron_exact``): ``(B ⊗ A + λ I)⁻¹`` from the eigendecompositions of both
  factors.

A single factor ``[B]`` is damped plainly: ``(B + λ I)⁻¹``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from curvopt.core.reductions import dense, diagonal, empty_like
from curvopt.optim.inverses import DampedInverse
from curvopt.optim.kron_exact import exact_damped_solve, kron_eigh
from curvopt.optim.factor_inverse import (
    Factors,
    LowRankInverse,
    add_diagonal,
    capped,
    capped_inverse,
    cholesky_factor,
    cholesky_inverse,
    cholesky_solve_right,
    promoted,
    trace_norm_ratio,
    trace_norm_shifts,
    usable_root,
    woodbury,
)
from curvopt.optim.trace_norm_eigh import eigh_solvers, trace_norm_eigh


def as_matrix(grad: torch.Tensor, factors: Factors) -> torch.Tensor:
    """A gradient as the matrix ``G`` the Kronecker factors act on.

    Args:
        grad: the gradient (any shape, e.g. ``[out, in, *kernel]``).
        factors: ``[B, A]`` or ``[B]``.

    Returns:
        ``grad.reshape(dim B, -1)``: ``[dim B, dim A]`` (``[dim B, 1]`` for ``[B]``).

    Raises:
        ValueError: the factor sizes do not multiply to ``grad.numel()``.

    Example:
        >>> import torch
        >>> from curvopt.optim import as_matrix
        >>> as_matrix(torch.zeros(4, 2, 3, 3), [torch.eye(4), torch.eye(18)]).shape
        torch.Size([4, 18])
    """
    sizes = [f.shape[0] for f in factors]
    expected = sizes[0] * (sizes[1] if len(sizes) == 2 else 1)
    if len(sizes) not in (1, 2) or expected != grad.numel():
        raise ValueError(
            f"Kronecker factors of sizes {sizes} do not match a parameter of shape "
            f"{tuple(grad.shape)}: expected [B, A] with dim B * dim A == numel or [B] with "
            "dim B == numel"
        )
    return grad.reshape(sizes[0], -1)


def trace_norm_pi(factors: Factors) -> torch.Tensor:
    """The trace-norm ratio ``π = sqrt((tr A / dim A) / (tr B / dim B))`` of ``[B, A]``.

    Martens & Grosse (2015, Sec. 6.3): the damping ``λ`` is split as ``π√λ`` on the input side
    ``A`` and ``√λ/π`` on the output side ``B``.

    Args:
        factors: ``[B, A]``, or ``[B]`` (then ``π = 1``).

    Returns:
        ``π``, a scalar tensor; also 1 when a trace is not positive (a zero factor), so that
        the damping stays ``λ I``.

    Example:
        >>> import torch
        >>> from curvopt import optim
        >>> B, A = 2 * torch.eye(2), 8 * torch.eye(3)  # tr B / 2 = 2, tr A / 3 = 8: π = 2
        >>> optim.trace_norm_pi([B, A])
        tensor(2.)
    """
    if len(factors) == 1:
        return torch.ones((), dtype=factors[0].dtype, device=factors[0].device)
    return trace_norm_ratio(*(diagonal(f).mean() for f in factors))


def trace_norm_damped(factors: Factors, damping: float) -> list[torch.Tensor]:
    """The trace-norm damped factors ``[B + √λ/π I, A + π√λ I]`` (``[B + λ I]`` for ``[B]``).

    Args:
        factors: ``[B, A]`` or ``[B]``.
        damping: ``λ ≥ 0``.

    Returns:
        The damped factors, dense.

    Example:
        >>> import torch
        >>> from curvopt import optim
        >>> B, A = 2 * torch.eye(2), 8 * torch.eye(3)  # tr B / 2 = 2, tr A / 3 = 8: π = 2
        >>> [f.diagonal().tolist() for f in optim.trace_norm_damped([B, A], damping=4.0)]
        [[3.0, 3.0], [12.0, 12.0, 12.0]]
    """
    return [
        add_diagonal(dense(f), shift)
        for f, shift in zip(factors, _trace_norm_shifts(factors, damping))
    ]


def _trace_norm_shifts(factors: Factors, damping: float) -> list:
    """The damping added to each factor (:func:`trace_norm_shifts` of their mean diagonals)."""
    return trace_norm_shifts([diagonal(f).mean() for f in factors], damping)


def trace_norm_inverse(factors: Factors, damping: float) -> list[torch.Tensor]:
    """The inverses of :func:`trace_norm_damped`'s factors (Cholesky, float64 retry).

    Apply them with :func:`kron_matmul`: ``(B' ⊗ A')⁻¹ vec(G) = vec(B'⁻¹ G A'⁻¹)``.

    Args:
        factors: ``[B, A]`` or ``[B]``.
        damping: ``λ ≥ 0``.

    Returns:
        ``[(B + √λ/π I)⁻¹, (A + π√λ I)⁻¹]`` (``[(B + λ I)⁻¹]``).

    Raises:
        torch.linalg.LinAlgError: a damped factor is not positive definite even in float64.

    Example:
        >>> import torch
        >>> from curvopt import optim
        >>> B, A = 2 * torch.eye(2), 8 * torch.eye(3)  # tr B / 2 = 2, tr A / 3 = 8: π = 2
        >>> inverses = optim.trace_norm_inverse([B, A], damping=4.0)
        >>> torch.allclose(inverses[0], torch.eye(2) / 3)
        True
        >>> torch.allclose(inverses[1], torch.eye(3) / 12)
        True
    """
    return [cholesky_inverse(f) for f in trace_norm_damped(factors, damping)]


def trace_norm_cholesky(
    factors: Factors, damping: float, low_rank: bool = True, max_rank: int | None = None
) -> list[torch.Tensor | LowRankInverse]:
    """Per trace-norm damped factor its Cholesky factor, or a Woodbury inverse where cheaper.

    Per factor of :func:`trace_norm_damped`: its Cholesky factor ``L``
    (:func:`cholesky_factor`, float64 retry), or, with ``low_rank`` and a positive shift, a
    :class:`LowRankInverse` where the factor carries a Gram root that makes that cheaper (a
    batch smaller than the layer's width). Factors in bfloat16/float16 are factorised in
    float32. Apply the result with :func:`kron_cholesky_solve`.

    Args:
        factors: ``[B, A]`` or ``[B]``.
        damping: ``λ ≥ 0``.
        low_rank: allow the Woodbury form (default ``True``).
        max_rank: ``None`` (default, exact) or ``k``: cap the rank of the Woodbury and
            eigenpair forms at ``k`` (an approximation).

    Returns:
        One entry per factor: a lower-triangular ``L`` or a :class:`LowRankInverse`.

    Raises:
        torch.linalg.LinAlgError: a factor cannot be factorised; the message names it
            (output-side ``B`` or input-side ``A``, its size, trace and shift).

    Example:
        >>> import torch
        >>> from curvopt import optim
        >>> B, A = 2 * torch.eye(2), 8 * torch.eye(3)  # tr B / 2 = 2, tr A / 3 = 8: π = 2
        >>> G = torch.ones(2, 3)
        >>> solvers = optim.trace_norm_cholesky([B, A], damping=4.0)
        >>> torch.allclose(optim.kron_cholesky_solve(solvers, G), G / 36)  # 1 / (3 * 12)
        True
    """
    return _trace_norm_solvers(factors, damping, low_rank, max_rank, cholesky_factor)


def trace_norm_solvers(
    factors: Factors, damping: float, low_rank: bool = True, max_rank: int | None = None
) -> list[torch.Tensor | LowRankInverse]:
    """As :func:`trace_norm_cholesky`, with the dense inverse ``(F + c I)⁻¹`` in place of ``L``.

    What ``KFAC`` caches when an inverse is applied again (``inverse_interval`` or
    ``curvature_interval`` above 1): a product with the inverse has the flops of two triangular
    solves but is one matrix product, and forming it from ``L`` costs ``2d³/3`` once per
    inversion. Apply the result with :func:`kron_solve`.

    Args:
        factors: ``[B, A]`` or ``[B]``.
        damping: ``λ ≥ 0``.
        low_rank: allow the Woodbury form (default ``True``).
        max_rank: ``None`` (default, exact) or a rank cap ``k`` (an approximation).

    Returns:
        One entry per factor: a dense inverse or a :class:`LowRankInverse`.

    Raises:
        torch.linalg.LinAlgError: a factor cannot be factorised (named in the message).

    Example:
        >>> import torch
        >>> from curvopt import optim
        >>> B, A = 2 * torch.eye(2), 8 * torch.eye(3)  # tr B / 2 = 2, tr A / 3 = 8: π = 2
        >>> G = torch.ones(2, 3)
        >>> solvers = optim.trace_norm_solvers([B, A], damping=4.0)
        >>> torch.allclose(optim.kron_solve(solvers, G), G / 36)
        True
    """
    return _trace_norm_solvers(factors, damping, low_rank, max_rank, cholesky_inverse)


def _trace_norm_solvers(factors, damping, low_rank, max_rank, inverse) -> list:
    """Per damped factor: ``inverse(F + c I)`` or a :class:`LowRankInverse` (see the callers)."""
    stored = [f.dtype for f in factors]
    factors = [promoted(f) for f in factors]
    shifts = _trace_norm_shifts(factors, damping)
    sizes = [f.shape[0] for f in factors]
    solvers = []
    for index, (factor, shift) in enumerate(zip(factors, shifts)):
        others = sizes[1 - index] if len(factors) == 2 else 1
        usable = low_rank and damping > 0
        root = usable_root(factor, others, stored[index]) if usable else None
        try:
            solver = None if root is None else woodbury(root, shift, others, max_rank)
            if solver is None and usable and capped(factor.shape[0], max_rank):
                solver = capped_inverse(factor, shift, max_rank)
            if solver is None:
                solver = inverse(add_diagonal(dense(factor), shift))
            solvers.append(solver)
        except torch.linalg.LinAlgError as error:
            raise torch.linalg.LinAlgError(
                f"{_FACTOR_NAMES[len(factors)][index]} {tuple(factor.shape)} (trace "
                f"{float(diagonal(factor).sum()):.3g}, damping shift {float(shift):.3g}"
                f"{', Woodbury form' if root is not None else ''}): {error}"
            ) from None
    return solvers


#: the factors' names by list length, as in the API order ``[B, A]`` / ``[B]``
_FACTOR_NAMES = {
    1: ["Kronecker factor B (bias)"],
    2: ["output-side Kronecker factor B", "input-side Kronecker factor A"],
}


def kron_cholesky_solve(solvers: Sequence, matrix: torch.Tensor) -> torch.Tensor:
    """The Kronecker solve ``(B ⊗ A)⁻¹ vec(G)`` as the matrix ``B⁻¹ G A⁻¹`` from Cholesky factors.

    From the entries of :func:`trace_norm_cholesky`: Cholesky factors ``L`` (``B = L_B L_Bᵀ``)
    solved by triangular solves (``2 dim_B² dim_A + 2 dim_B dim_A²`` flops), or
    :class:`LowRankInverse` applied by Woodbury.

    Args:
        solvers: one entry per factor, from :func:`trace_norm_cholesky`.
        matrix: ``G``, ``[dim B, dim A]`` (``[dim B, k]`` for ``[B]``).

    Returns:
        ``B⁻¹ G A⁻¹`` (``B⁻¹ G``), solved in the solvers' precision, in ``matrix``'s dtype.

    Example:
        >>> import torch
        >>> from curvopt import optim
        >>> B, A = 2 * torch.eye(2), 8 * torch.eye(3)  # tr B / 2 = 2, tr A / 3 = 8: π = 2
        >>> solvers = optim.trace_norm_cholesky([B, A], damping=0.0)
        >>> G = torch.full((2, 3), 16.0)
        >>> torch.allclose(optim.kron_cholesky_solve(solvers, G), torch.ones(2, 3))
        True
    """
    return _kron_apply(solvers, matrix, torch.cholesky_solve, cholesky_solve_right)


def kron_solve(solvers: Sequence, matrix: torch.Tensor) -> torch.Tensor:
    """The Kronecker solve ``B⁻¹ G A⁻¹`` (``B⁻¹ G`` for ``[B]``) from dense inverses.

    From the entries of :func:`trace_norm_solvers`: dense inverses applied by matrix products,
    or :class:`LowRankInverse` by Woodbury.

    Args:
        solvers: one entry per factor, from :func:`trace_norm_solvers`.
        matrix: ``G``, ``[dim B, dim A]`` (``[dim B, k]`` for ``[B]``).

    Returns:
        ``B⁻¹ G A⁻¹``, in the solvers' precision, returned in ``matrix``'s dtype.

    Example:
        >>> import torch
        >>> from curvopt import optim
        >>> B, A = 2 * torch.eye(2), 8 * torch.eye(3)  # tr B / 2 = 2, tr A / 3 = 8: π = 2
        >>> solvers = optim.trace_norm_solvers([B, A], damping=0.0)
        >>> G = torch.full((2, 3), 16.0)
        >>> torch.allclose(optim.kron_solve(solvers, G), torch.ones(2, 3))
        True
    """
    return _kron_apply(solvers, matrix, lambda m, f: f @ m, lambda m, f: m @ f)


def _kron_apply(solvers, matrix, dense_left, dense_right) -> torch.Tensor:
    """``B⁻¹ G A⁻¹`` with dense entries applied as ``dense_left(G, ·)`` / ``dense_right(G, ·)``
    and :class:`LowRankInverse` entries by Woodbury."""
    dtype = matrix.dtype
    left = solvers[0]
    matrix = matrix.to(left.basis.dtype if isinstance(left, LowRankInverse) else left.dtype)
    if isinstance(left, LowRankInverse):
        result = left.solve_left(matrix)
    else:
        result = dense_left(matrix, left)
    if len(solvers) == 2:
        right = solvers[1]
        if isinstance(right, LowRankInverse):
            result = right.solve_right(result)
        else:
            result = dense_right(result, right)
    return result.to(dtype)


@dataclass(frozen=True)
class InverseOptions:
    """How a Kronecker inverse is built: ``kronecker_damping`` ``"trace_norm"``,
    ``"trace_norm_eigh"`` or ``"exact"``; ``reused``: applied again (so dense inverses, not
    Cholesky factors, are worth forming); ``low_rank``: Woodbury for factors with a Gram root
    (and the rank cap); ``max_rank``: the trace-norm inverses of factors wider than
    ``2 · max_rank`` from their top ``max_rank`` eigenpairs (an approximation)."""

    kronecker_damping: str = "trace_norm"
    reused: bool = False
    low_rank: bool = True
    max_rank: int | None = None

    @property
    def kind(self) -> str:
        """The name of what is computed (and cached): ``eigh``, ``trace_norm_eigh``,
        ``inverse`` or ``cholesky``."""
        if self.kronecker_damping == "exact":
            return "eigh"
        if self.kronecker_damping == "trace_norm_eigh":
            return "trace_norm_eigh"
        return "inverse" if self.reused else "cholesky"


@dataclass(frozen=True)
class KroneckerInverse(DampedInverse):
    """``(F_0 ⊗ F_1 + λ I)⁻¹`` (``[B]``: ``(B + λ I)⁻¹``): by the trace-norm split into damped
    factors (``kind`` ``"cholesky"``: their Cholesky factors; ``"inverse"``: their inverses;
    ``"trace_norm_eigh"``: their eigendecompositions) or exactly through eigendecompositions
    (``"eigh"``); ``value`` is what ``kind`` computed."""

    kind: str
    value: Any
    damping: float
    #: ``dim F_0``: the rows of the parameter as the matrix ``G``
    rows: int

    @classmethod
    def build(
        cls, curvature: Sequence[torch.Tensor], damping: float, options: InverseOptions
    ) -> "KroneckerInverse":
        value = cls.compute(curvature, damping, options)
        return cls(options.kind, value, damping, curvature[0].shape[0])

    @staticmethod
    def compute(curvature, damping: float, options: InverseOptions):
        """The ``value`` of :meth:`build`, without the wrapper (what the optimizers cache)."""
        if options.kind == "eigh":
            return kron_eigh([dense(f) for f in curvature])
        if options.kind == "trace_norm_eigh":
            return trace_norm_eigh(curvature, options.low_rank, options.max_rank)
        build = trace_norm_solvers if options.reused else trace_norm_cholesky
        return build(curvature, damping, options.low_rank, options.max_rank)

    @staticmethod
    def empty(curvature, options: InverseOptions):
        """Uninitialised tensors of :meth:`compute`'s structure (to receive a broadcast)."""
        if options.kind == "eigh":
            return [(empty_like(f, f.shape[0]), empty_like(f)) for f in curvature]
        if options.kind == "trace_norm_eigh":  # full decompositions: no Woodbury when spread
            return [
                (empty_like(f, d := f.shape[0]), empty_like(f, d, _kept(d, options)))
                for f in curvature
            ]
        return [empty_like(f) for f in curvature]

    @property
    def solve(self):
        """``(solvers, matrix) ↦`` the damped solve of a trace-norm ``value``."""
        return kron_cholesky_solve if self.kind == "cholesky" else kron_solve

    def apply_one(self, grad):
        matrix = grad.reshape(self.rows, -1)
        if self.kind == "eigh":
            direction = exact_damped_solve(self.value, matrix, self.damping)
        elif self.kind == "trace_norm_eigh":
            direction = kron_solve(eigh_solvers(self.value, self.damping), matrix)
        else:
            direction = self.solve(self.value, matrix)
        return direction.reshape(grad.shape)


def _kept(dim: int, options: InverseOptions) -> int:
    """The eigenvectors ``trace_norm_eigh`` keeps of a factor of size ``dim`` (no Gram root)."""
    return options.max_rank if capped(dim, options.max_rank) else dim
