"""``(C + λ I)⁻¹`` of one parameter's curvature: one ``DampedInverse`` per curvature type,
shared by the optimizers' preconditioning (the precondition stage) and ``curvopt.linalg``'s
``inverse()`` operators.

``build(curvature, damping, options)`` computes what the inverse needs once (nothing for a
diagonal; Cholesky factors, inverses or eigendecompositions of Kronecker factors);
``apply(matrices)`` applies it to a batch ``[K, *p.shape]``. Here: the base class,
:class:`DiagonalInverse` and :class:`EigenCorrectedInverse`; the Kronecker block's,
``KroneckerInverse``, is in ``kronecker`` (its trace-norm damping: ``trace_norm``). The
optimizers cache the computed part in their state (``value``, plain tensors: it is saved with
``state_dict`` and broadcast under ``torch.distributed``) and wrap it again with the class's
constructor. The batch is applied one matrix at a time, with the kernels of a step, so that
``linalg``'s inverse is the optimizer's direction to the last bit (batched products round
differently).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import torch

from curvopt.inversion.diagonal import diag_precondition
from curvopt.inversion.eigen_corrected import as_rows, rotate


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
class EigenCorrectedInverse(DampedInverse):
    """``(Q diag(S) Qᵀ + λ I)⁻¹ g = Q [(Qᵀ g) ⊘ (vec S + λ)]``."""

    correction: torch.Tensor
    bases: Sequence[torch.Tensor]
    damping: float

    @classmethod
    def build(cls, curvature, damping: float, options=None) -> "EigenCorrectedInverse":
        return cls(curvature[0], list(curvature[1:]), damping)

    def apply_one(self, grad):
        return self.apply_with_coordinates(grad)[0]

    @functools.cached_property
    def divisor(self) -> torch.Tensor:
        """``S + λ``, formed once per inverse (``EKFAC`` keeps its inverse between refreshes:
        a plain step divides by it and adds nothing)."""
        return self.correction + self.damping

    @functools.cached_property
    def transposed(self) -> list[torch.Tensor]:
        """``[Q.mT for Q in bases]``: the views the rotations take, formed once per inverse."""
        return [basis.mT for basis in self.bases]

    def apply_with_coordinates(self, grad) -> tuple[torch.Tensor, torch.Tensor]:
        """``(d, Q_Bᵀ D Q_A)``: :meth:`apply_one`'s direction and its coordinates in the basis
        (``eigen_corrected_coordinates``' ``(Q_Bᵀ G Q_A) / (S + λ)``, the solve's
        intermediate, with :attr:`divisor`), ``[dim B, dim A]``."""
        rows, transposed = as_rows(grad, self.bases), self.transposed
        rotated = rotate(self.bases, rows, transposed=transposed) / self.divisor
        solved = rotate(self.bases, rotated, back=True, transposed=transposed)
        if solved.dtype != rows.dtype:
            solved = solved.to(rows.dtype)
        if solved.shape != grad.shape:  # (no view formed where it has its shape already)
            solved = solved.reshape(grad.shape)
        return solved, rotated
