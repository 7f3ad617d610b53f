"""The eigenbasis of a parameter's (averaged) Kronecker factors, refreshed every
``basis_interval`` steps, with Adam's moments carried into the new basis (``EigenAdam``).

A weight's gradient is the matrix ``G = grad.reshape(dim B, -1)`` (``[dim B, 1]`` for a
parameter with the one factor ``[B]``), its factors ``[B, A]`` (``[dim B]²``, ``[dim A]²``);
factors stacked per group (``[G, d, d]``, a grouped convolution's) give stacked bases, and
``G`` is then the matrices ``grad.reshape(G, rows / G, -1)``, each rotated by its group's.
On a basis step the stage takes the eigenvectors of each factor, ``B = Q_B diag(s_B) Q_Bᵀ``,
``A = Q_A diag(s_A) Q_Aᵀ`` (:func:`~curvopt.core.psd.psd_eigh`), and keeps them as the
parameter's basis ``[Q_B, Q_A]`` until the next one; a side wider than ``max_basis_dim`` keeps
the identity (``None``: its factor is never decomposed, SOAP's one-sided preconditioning).
With ``basis_refresh="warm"`` the refreshes after the first start from the last basis and take
one power step and a QR instead (:mod:`~curvopt.inversion.warm_eigh`, SOAP's refresh).

Adam's moments ``m`` and ``v`` (``[dim B, dim A]``, kept in the basis, see
:mod:`~curvopt.optim.stages.eigenbasis_adam`) move with the basis. With ``R_B = Q_Bᵀ Q'_B``
and ``R_A = Q_Aᵀ Q'_A`` from the old basis ``Q`` to the new one ``Q'``::

    m ← R_Bᵀ m R_A                       exact: Q'ᵀ Q m, the same vector in the new basis
    v ← (R_B ⊙ R_B)ᵀ v (R_A ⊙ R_A)       v's diagonal second moment Q diag(vec v) Qᵀ,
                                         projected onto the matrices diagonal in Q'

The second line is SOAP's (Vyas et al. 2024) carrying of ``v`` across a basis change made
exact for any new basis: a second moment diagonal in the old basis has, in the new one, the
diagonal ``diag(Q'ᵀ Q diag(vec v) Qᵀ Q') = (R ⊙ R)ᵀ vec v``. It keeps ``v ≥ 0`` and its sum,
it is ``v`` itself for an unchanged basis and ``v`` permuted when the new basis is the old one
with its columns reordered or their signs flipped (SOAP's QR refresh permutes ``v`` by the
estimated eigenvalues; an ``eigh`` orders and signs its eigenvectors anew at every call).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from curvopt.core.psd import psd_eigh
from curvopt.core.reductions import dense
from curvopt.inversion.warm_eigh import warm_eigenbasis
from curvopt.optim.stages.base import GroupStep, Stage

#: per side an orthogonal ``[d, d]`` basis, or ``None`` (the identity)
Bases = Sequence[torch.Tensor | None]


class RefreshEigenbasis(Stage):
    """Keep the curvature in use (``state["curvature"]``, averaged by the EMA stage before), and
    on basis steps (the group's step a multiple of ``basis_interval``, or no basis yet) replace
    ``state["eigenbasis"]`` by the factors' eigenvectors (:func:`eigenbasis`; warm-started
    from the old basis under ``basis_refresh="warm"``), carrying the stored moments into it
    (:func:`carry_moments`). A parameter without curvature (its fallback
    steps it in the identity basis) is left alone."""

    order = 25

    def __call__(self, step: GroupStep) -> None:
        interval, max_dim = step.group["basis_interval"], step.group["max_basis_dim"]
        for item in step.params:
            if item.curvature is None:
                continue
            state = item.update.state
            state.update(curvature=item.curvature, curvature_step=item.curvature_step)
            old = item.state.get("eigenbasis")
            if old is not None and step.step % interval:
                state.update(eigenbasis=old, basis_step=item.state["basis_step"])
                continue
            warm = step.group["basis_refresh"] == "warm"
            new = eigenbasis(item.curvature, max_dim, old if warm else None)
            state.update(eigenbasis=new, basis_step=step.step)
            if "exp_avg" in item.state:
                m, v = carry_moments(item.state["exp_avg"], item.state["exp_avg_sq"], old, new)
                state.update(exp_avg=m, exp_avg_sq=v)


def eigenbasis(
    factors: Sequence[Any], max_dim: int | None = None, previous: Bases | None = None
) -> list[torch.Tensor | None]:
    """Per factor its eigenvectors ``Q`` (``F = Q diag(s) Qᵀ``, :func:`psd_eigh`, float32 at
    least), ``None`` (the identity) for a factor wider than ``max_dim``; a side with a
    ``previous`` basis refreshed from it instead (one power step and a QR,
    :func:`~curvopt.inversion.warm_eigh.warm_eigenbasis`: approximate eigenvectors).

    Args:
        factors: ``[B, A]`` or ``[B]``, square symmetric PSD (dense or ``GramFactor``;
            or stacked per group, ``[G, d, d]``).
        max_dim: ``None`` (every side rotated) or the widest side that is.
        previous: ``None`` (default: exact eigenvectors) or the last bases, one per factor
            (``None`` entries: that side decomposed exactly).

    Returns:
        ``[Q_B, Q_A]`` (``[Q_B]``), each ``[d, d]`` orthogonal (``[G, d, d]``) or ``None``.

    Example:
        >>> eigenbasis([torch.diag(torch.tensor([2.0, 1.0]))])[0].abs()
        tensor([[0., 1.],
                [1., 0.]])
    """
    previous = [None] * len(factors) if previous is None else previous
    return [
        None if max_dim is not None and f.shape[-1] > max_dim else _refreshed(f, q)
        for f, q in zip(factors, previous)
    ]


def _refreshed(factor, previous: torch.Tensor | None) -> torch.Tensor:
    """The eigenvectors of one factor: exact, or warm-started from ``previous``."""
    if previous is None:
        return psd_eigh(dense(factor))[1]
    return warm_eigenbasis(factor, previous)[1]


def rotate(bases: Bases, tensor: torch.Tensor, back: bool = False) -> torch.Tensor:
    """``Q_Bᵀ G Q_A`` into the basis (``back``: ``Q_B G Q_Aᵀ`` out of it), ``G`` the
    ``[tensor.shape[0], -1]`` matrix of ``tensor`` (the rows of ``B``, as
    :mod:`~curvopt.optim.one_sided` has them); ``None`` sides are the identity. As
    ``layers.eigenbasis.rotate``, which takes no identity sides.

    Args:
        bases: ``[Q_B, Q_A]``, ``[Q_B]`` or ``[]`` (each ``[d, d]`` or ``None``).
        tensor: a parameter-shaped tensor with ``dim B · dim A`` entries.
        back: rotate out of the basis instead of into it.

    Returns:
        The rotated tensor, shaped as ``tensor``, in the bases' dtype (``tensor``'s if none).

    Example:
        >>> q = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
        >>> rotate([q, None], torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
        tensor([[3., 4.],
                [1., 2.]])
    """
    kept = [q for q in bases if q is not None]
    if not kept:
        return tensor
    rows = (tensor.shape[0],)
    if kept[0].dim() == 3:  # stacked per group: the matrices [G, rows / G, ·]
        rows = (len(kept[0]), tensor.shape[0] // len(kept[0]))
    matrix = tensor.to(kept[0].dtype).reshape(*rows, -1)
    if bases[0] is not None:
        matrix = (bases[0] if back else bases[0].mT) @ matrix
    if len(bases) == 2 and bases[1] is not None:
        matrix = matrix @ (bases[1].mT if back else bases[1])
    return matrix.reshape(tensor.shape)


def carry_moments(
    exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, old: Bases | None, new: Bases
) -> tuple[torch.Tensor, torch.Tensor]:
    """Adam's moments of the basis ``old`` in the basis ``new``: ``m ← R_Bᵀ m R_A`` and
    ``v ← (R_B ⊙ R_B)ᵀ v (R_A ⊙ R_A)``, ``R = Q_oldᵀ Q_new`` per side (see the module).

    Args:
        exp_avg: ``m``, parameter-shaped, in the basis ``old``.
        exp_avg_sq: ``v``, parameter-shaped, in the basis ``old``.
        old: the bases ``m`` and ``v`` are in (``None``: the identity on every side).
        new: the bases to carry them into.

    Returns:
        ``(m, v)`` in the basis ``new``, shaped as given.

    Example:
        >>> q = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
        >>> m, v = carry_moments(torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0]), None, [q])
        >>> m, v
        (tensor([2., 1.]), tensor([4., 3.]))
    """
    old = [None] * len(new) if old is None else old
    turns = [_turn(q, q_new) for q, q_new in zip(old, new)]
    squared = [None if r is None else r * r for r in turns]
    return rotate(turns, exp_avg), rotate(squared, exp_avg_sq)


def _turn(old: torch.Tensor | None, new: torch.Tensor | None) -> torch.Tensor | None:
    """``R = Q_oldᵀ Q_new`` of one side (``None`` for two identities)."""
    if old is None:
        return new
    return old.mT if new is None else old.mT @ new
