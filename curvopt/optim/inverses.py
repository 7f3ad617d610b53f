"""``(C + λ I)⁻¹`` of one parameter's curvature: one ``DampedInverse`` per curvature type,
shared by the optimizers' preconditioning (the precondition stage) and ``curvopt.linalg``'s
``inverse()`` operators.

``build(curvature, damping, options)`` computes what the inverse needs once (nothing for a
diagonal; Cholesky factors, inverses or eigendecompositions of Kronecker factors,
:class:`InverseOptions`); ``apply(matrices)`` applies it to a batch ``[K, *p.shape]``. The
optimizers cache the computed part in their state (``value``, plain tensors: it is saved with
``state_dict`` and broadcast under ``torch.distributed``) and wrap it again with the class's
constructor. The batch is applied one matrix at a time, with the kernels of a step, so that
``linalg``'s inverse is the optimizer's direction to the last bit (batched products round
differently).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from curvopt.optim.diagonal import diag_precondition
from curvopt.optim.eigen_corrected import as_rows, eigen_corrected_solve
from curvopt.optim.kron_exact import exact_damped_solve, kron_eigh
from curvopt.optim.kronecker import (
    capped,
    kron_cholesky_solve,
    kron_solve,
    trace_norm_cholesky,
    trace_norm_solvers,
)
from curvopt.optim.trace_norm_eigh import eigh_solvers, trace_norm_eigh


class DampedInverse:
    """``(C + λ I)⁻¹`` for one parameter; subclasses implement :meth:`apply_one`."""

    def apply_one(self, grad: torch.Tensor) -> torch.Tensor:
        """``(C + λ I)⁻¹ g`` for one ``g`` of the parameter's shape."""
        raise NotImplementedError

    def apply(self, matrices: torch.Tensor) -> torch.Tensor:
        """``[K, *p.shape] ↦ (C + λ I)⁻¹`` of each of the ``K``."""
        result = torch.empty_like(matrices)
        for index, matrix in enumerate(matrices):
            result[index] = self.apply_one(matrix)
        return result


@dataclass(frozen=True)
class DiagonalInverse(DampedInverse):
    """``(diag(c) + λ I)⁻¹ g = g / (c + λ)``."""

    diagonal: torch.Tensor
    damping: float

    @classmethod
    def build(cls, curvature: torch.Tensor, damping: float, options=None) -> "DiagonalInverse":
        return cls(curvature, damping)

    def apply_one(self, grad):
        return diag_precondition(grad, self.diagonal, self.damping)


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
            return kron_eigh(curvature)
        if options.kind == "trace_norm_eigh":
            return trace_norm_eigh(curvature, options.low_rank, options.max_rank)
        build = trace_norm_solvers if options.reused else trace_norm_cholesky
        return build(curvature, damping, options.low_rank, options.max_rank)

    @staticmethod
    def empty(curvature, options: InverseOptions):
        """Uninitialised tensors of :meth:`compute`'s structure (to receive a broadcast)."""
        if options.kind == "eigh":
            return [(f.new_empty(f.shape[0]), torch.empty_like(f)) for f in curvature]
        if options.kind == "trace_norm_eigh":  # full decompositions: no Woodbury when spread
            return [
                (f.new_empty(d := f.shape[0]), f.new_empty(d, _kept(d, options))) for f in curvature
            ]
        return [torch.empty_like(f) for f in curvature]

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


@dataclass(frozen=True)
class EigenCorrectedInverse(DampedInverse):
    """``(Q diag(S) Qᵀ + λ I)⁻¹ g = Q [(Qᵀ g) ⊘ (vec S + λ)]``."""

    correction: torch.Tensor
    bases: Sequence[torch.Tensor]
    damping: float

    @classmethod
    def build(cls, curvature, damping: float, options=None) -> "EigenCorrectedInverse":
        return cls(curvature[0], list(curvature[1:]), damping)

    def apply_one(self, grad):
        rows = as_rows(grad, self.bases)
        solved = eigen_corrected_solve(self.bases, self.correction, rows, self.damping)
        return solved.reshape(grad.shape)
