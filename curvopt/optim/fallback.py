"""Preconditioning for parameters without curvature: ``fallback='adam'`` of ``optim.KFAC``.

A ViT's class token and position embeddings (raw 3-D parameters) have no Kronecker
factorisation; with ``fallback='adam'`` ``optim.KFAC`` collects with
``curvopt.collect(..., skip_unsupported=True)`` and steps each such parameter by a diagonal
Adam-style direction (no momentum, which the optimizer's own ``momentum`` adds on top)::

    v ← β v + (1 − β) g²,   v̂ = v / (1 − βᵗ),   d = g / (√v̂ + ε)

with ``g`` the weight-decayed gradient, ``β = 0.999``, ``ε = 1e-8``, ``t`` the parameter's
fallback step count. Chosen over a diagonal GGN because it needs nothing from the backward
pass: collecting ``DiagGGNMC`` would compute diagonals for *every* parameter of the model
(``collect`` writes for all) to precondition a few thousand entries.
"""

from __future__ import annotations

import torch

BETA = 0.999
EPS = 1e-8


def adam_direction(grad: torch.Tensor, state: dict) -> tuple[torch.Tensor, dict]:
    """``(d, new state)`` from the state of the previous fallback step (never modified)."""
    t = state.get("fallback_step", 0) + 1
    old = state.get("fallback_sq")
    sq = (1 - BETA) * grad.square() if old is None else BETA * old + (1 - BETA) * grad.square()
    direction = grad / ((sq / (1 - BETA**t)).sqrt() + EPS)
    return direction, {"fallback_sq": sq, "fallback_step": t}
