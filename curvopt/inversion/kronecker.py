"""The Kronecker block ``C = B ⊗ A`` of one parameter: its products and its damped inverse
:class:`KroneckerInverse` (the ``DampedInverse`` that ``KFAC`` and ``curvopt.linalg`` apply),
built as :class:`InverseOptions` say.

Factors come as a list in the API order: ``[B, A]`` for a weight of shape ``[out, in, *k]``
(``B``: ``[out, out]``, output side; ``A``: ``[in·k, in·k]``, input side) or ``[B]`` for a bias.
A gradient is handled as the matrix ``G = grad.reshape(out, -1)`` of shape ``[out, in·k]``
(``[out, 1]`` for a bias, :func:`as_matrix`), so that with row-major ``vec``
``(B ⊗ A) vec(G) = vec(B G Aᵀ)`` (:func:`kron_matmul`, :func:`kron_quadratic`), and ``B ⊗ A``
is never formed. Three ways to damp by ``λ`` (``kronecker_damping``):

* ``"trace_norm"``: ``(B + √λ/π I)⁻¹ ⊗ (A + π√λ I)⁻¹``, each factor damped in proportion to its
  own scale (``inversion.trace_norm``, each damped factor inverted by ``factor_inverse``);
* ``"trace_norm_eigh"``: the same split in the factors' eigenbases (``inversion.trace_norm``);
* ``"exact"``: ``(B ⊗ A + λ I)⁻¹`` from the eigendecompositions of both factors
  (:func:`kron_eigh`, :func:`exact_damped_solve`, here).

A single factor ``[B]`` is damped plainly: ``(B + λ I)⁻¹``.

A grouped convolution's factors are stacked per group, ``B [G, out/G, out/G]`` and
``A [G, in/G·k, in/G·k]`` (``[B]`` for its bias), the block-diagonal ``⊕_g B_g ⊗ A_g``; its
gradient is the matrices ``G = grad.reshape(G, out/G, -1)``, one per group, and every product,
damping and inverse here acts on each group's block (batched over the groups).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from curvopt.core.psd import psd_eigh
from curvopt.core.reductions import dense, empty_like
from curvopt.inversion.factor_inverse import capped
from curvopt.inversion.inverses import DampedInverse
from curvopt.inversion.trace_norm import (
    Factors,
    eigh_solvers,
    kron_applier,
    kron_cholesky_solve,
    kron_solve,
    trace_norm_cholesky,
    trace_norm_eigh,
    trace_norm_solvers,
)


def as_matrix(grad: torch.Tensor, factors: Factors) -> torch.Tensor:
    """A gradient as the matrix ``G`` the Kronecker factors act on.

    Args:
        grad: the gradient (any shape, e.g. ``[out, in, *kernel]``).
        factors: ``[B, A]`` or ``[B]``.

    Returns:
        ``grad.reshape(dim B, -1)``: ``[dim B, dim A]`` (``[dim B, 1]`` for ``[B]``); for
        factors stacked per group (``[G, d, d]``), ``grad.reshape(G, dim B, -1)``.

    Raises:
        ValueError: the factor sizes do not multiply to ``grad.numel()``.

    Example:
        >>> import torch
        >>> from curvopt.optim import as_matrix
        >>> as_matrix(torch.zeros(4, 2, 3, 3), [torch.eye(4), torch.eye(18)]).shape
        torch.Size([4, 18])
    """
    sizes = [f.shape[-1] for f in factors]
    groups = {tuple(f.shape[:-2]) for f in factors}
    expected = math.prod(factors[0].shape[:-1]) * (sizes[1] if len(sizes) == 2 else 1)
    if len(sizes) not in (1, 2) or expected != grad.numel() or len(groups) != 1:
        raise ValueError(
            f"Kronecker factors of shapes {[tuple(f.shape) for f in factors]} do not match a "
            f"parameter of shape {tuple(grad.shape)}: expected [B, A] with dim B * dim A == "
            "numel or [B] with dim B == numel (stacked per group [G, d, d]: G times that)"
        )
    return grad.reshape(*factors[0].shape[:-1], -1)


def kron_matmul(factors: Factors, matrix: torch.Tensor) -> torch.Tensor:
    """The Kronecker product ``(B ⊗ A) vec(G)``, as the matrix ``B G Aᵀ`` (``B G`` for ``[B]``).

    ``B ⊗ A`` is never formed; with row-major ``vec`` the result is indexed like ``vec(G)``.

    Args:
        factors: ``[B, A]`` (``B`` ``[m, m]``, ``A`` ``[n, n]``) or ``[B]``.
        matrix: ``G``, ``[m, n]`` (``[m, k]`` for ``[B]``).

    Returns:
        ``B G Aᵀ``, ``[m, n]``.

    Example:
        >>> import torch
        >>> from curvopt import optim
        >>> B, A = torch.diag(torch.tensor([2.0, 4.0])), torch.eye(3)
        >>> G = torch.ones(2, 3)
        >>> optim.kron_matmul([B, A], G)
        tensor([[2., 2., 2.],
                [4., 4., 4.]])
        >>> torch.allclose(torch.kron(B, A) @ G.flatten(), optim.kron_matmul([B, A], G).flatten())
        True
    """
    result = factors[0] @ matrix
    if len(factors) == 2:
        result = result @ factors[1].mT
    return result


def kron_quadratic(factors: Factors, matrix: torch.Tensor) -> torch.Tensor:
    """The quadratic form ``vec(S)ᵀ (B ⊗ A) vec(S) = Σ S ⊙ (B S Aᵀ)``.

    Args:
        factors: ``[B, A]`` or ``[B]``, as for :func:`kron_matmul`.
        matrix: ``S``, ``[dim B, dim A]``.

    Returns:
        A scalar tensor.

    Example:
        >>> import torch
        >>> from curvopt import optim
        >>> B, A = torch.diag(torch.tensor([2.0, 4.0])), torch.eye(3)
        >>> G = torch.ones(2, 3)
        >>> optim.kron_quadratic([B, A], G)
        tensor(18.)
    """
    return (matrix * kron_matmul(factors, matrix)).sum()


def kron_eigh(factors: Factors) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The eigendecompositions ``[(s_B, Q_B), (s_A, Q_A)]`` of PSD Kronecker factors.

    Each is :func:`psd_eigh`'s: eigenvalues clipped at 0, orthogonal ``Q``, ``F = Q diag(s) Qᵀ``.

    Args:
        factors: ``[B, A]`` or ``[B]``, symmetric PSD.

    Returns:
        One ``(s, Q)`` per factor (``s`` ``[d]``, ``Q`` ``[d, d]``).

    Example:
        >>> import torch
        >>> from curvopt import optim
        >>> B, A = torch.diag(torch.tensor([2.0, 4.0])), torch.eye(3)
        >>> G = torch.ones(2, 3)
        >>> [s.tolist() for s, _ in optim.kron_eigh([B, A])]
        [[2.0, 4.0], [1.0, 1.0, 1.0]]
    """
    return [psd_eigh(f) for f in factors]


def exact_damped_solve(
    eigs: Sequence[tuple[torch.Tensor, torch.Tensor]], matrix: torch.Tensor, damping: float
) -> torch.Tensor:
    """The exactly damped Kronecker solve ``(B ⊗ A + λ I)⁻¹ vec(G)``, as a matrix.

    From ``eigs = kron_eigh([B, A])``::

        Q_B [(Q_Bᵀ G Q_A) / (s_B s_Aᵀ + λ)] Q_Aᵀ

    (``Q_B [(Q_Bᵀ G) / (s_B + λ)]`` for ``[B]``): what ``KFAC(kronecker_damping="exact")``
    applies.

    Args:
        eigs: the eigendecompositions of the factors (:func:`kron_eigh`).
        matrix: ``G``, ``[dim B, dim A]``.
        damping: ``λ``.

    Returns:
        The solution as a ``[dim B, dim A]`` matrix, computed in the eigenvectors' precision and
        returned in ``matrix``'s dtype.

    Example:
        >>> import torch
        >>> from curvopt import optim
        >>> B, A = torch.diag(torch.tensor([2.0, 4.0])), torch.eye(3)
        >>> G = torch.ones(2, 3)
        >>> optim.exact_damped_solve(optim.kron_eigh([B, A]), G, damping=2.0)
        tensor([[0.2500, 0.2500, 0.2500],
                [0.1667, 0.1667, 0.1667]])
    """
    values = [s for s, _ in eigs]
    vectors = [q for _, q in eigs]
    spectrum = values[0][..., :, None] * (values[1][..., None, :] if len(eigs) == 2 else 1)
    rotated = kron_matmul([q.mT for q in vectors], matrix.to(vectors[0].dtype))
    return kron_matmul(vectors, rotated / (spectrum + damping)).to(matrix.dtype)


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
    #: ``(dim F_0,)``: the rows of the parameter as the matrix ``G`` (``(G, dim F_0)`` for
    #: factors stacked per group: ``G`` such matrices)
    rows: tuple

    @classmethod
    def build(
        cls, curvature: Sequence[torch.Tensor], damping: float, options: InverseOptions
    ) -> "KroneckerInverse":
        value = cls.compute(curvature, damping, options)
        return cls(options.kind, value, damping, tuple(curvature[0].shape[:-1]))

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
            return [(empty_like(f, *f.shape[:-1]), empty_like(f)) for f in curvature]
        if options.kind == "trace_norm_eigh":  # full decompositions: no Woodbury when spread
            return [
                (empty_like(f, *f.shape[:-1]), empty_like(f, *f.shape[:-1], _kept(f, options)))
                for f in curvature
            ]
        return [empty_like(f) for f in curvature]

    @property
    def solve(self):
        """``(solvers, matrix) ↦`` the damped solve of a trace-norm ``value``."""
        return kron_cholesky_solve if self.kind == "cholesky" else kron_solve

    @functools.cached_property
    def applied(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """``G ↦`` the damped solve of ``G`` (``[*rows, ·]``), resolved once per inverse (its
        kind, the solvers' precision and forms: ``trace_norm.kron_applier``), so that an
        inverse kept from step to step (``KFAC``'s plain steps) re-derives none of it."""
        if self.kind == "eigh":
            return functools.partial(_exact_solve, self.value, self.damping)
        if self.kind == "trace_norm_eigh":
            return kron_applier(eigh_solvers(self.value, self.damping))
        return kron_applier(self.value, cholesky=self.kind == "cholesky")

    def apply_one(self, grad):
        # (no view formed where the gradient and the direction have their shapes already)
        matrix = grad if grad.shape[:-1] == self.rows else grad.reshape(*self.rows, -1)
        direction = self.applied(matrix)
        return direction if direction.shape == grad.shape else direction.reshape(grad.shape)


def _exact_solve(value, damping: float, matrix: torch.Tensor) -> torch.Tensor:
    """:func:`exact_damped_solve` with the matrix last (``KroneckerInverse.applied``)."""
    return exact_damped_solve(value, matrix, damping)


def _kept(factor, options: InverseOptions) -> int:
    """The eigenvectors ``trace_norm_eigh`` keeps of a factor (no Gram root; all of stacked
    factors ``[G, d, d]``)."""
    dim = factor.shape[-1]
    return options.max_rank if len(factor.shape) == 2 and capped(dim, options.max_rank) else dim
