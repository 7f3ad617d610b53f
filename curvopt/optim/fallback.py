"""``fallback='diagonal'`` of ``optim.KFAC``: parameters without Kronecker factors.

A ViT's class token and position embeddings (raw 3-D parameters) and recurrent weights have
no Kronecker factorisation. ``optim.KFAC(..., fallback='diagonal')`` collects with
``curvopt.collect(..., skip_unsupported="diagonal")``, which writes for such a parameter the
diagonal ``c`` of the same curvature instead (``p.kfac_diagonal``: the Monte-Carlo GGN diagonal
from the sampled columns KFAC propagates anyway; ``p.kflr_diagonal``: the exact one), and steps
it by the damped diagonal Newton direction ``d = g / (c + λ + δ)`` of ``DiagGGNNewton``, with
the same ``λ`` as the Kronecker blocks: the same scale as every other parameter's step.
Between curvature updates (``curvature_interval > 1``) the last diagonal is reused.

Alternatives measured on two tiny ViTs (issue 21): ``fallback='sgd'`` (``d = g``, no extra
work; the diagonal costs one more pass of the columns through the owning module) trains about
as well there; an Adam-style ``d = g / (√v̂ + ε)`` stalled or diverged at KFAC's learning rates
(its step per entry ignores the curvature scale) and was dropped.
"""

from __future__ import annotations


from curvopt.engine import values
from curvopt.optim.diagonal import diag_precondition


def fallback_diagonal(optimizer, update, grad, state, writer, damping):
    """``(d, new state)``: ``d = g / (c + λ)`` with ``c`` the diagonal the extension class
    ``writer`` declares for parameters without factors (``writer.fallback``, e.g.
    ``p.kfac_diagonal``) when it is fresh, else the diagonal of the last update
    (``state["fallback_diagonal"]``)."""
    name = writer.fallback.attr
    param = update.param
    value = values.read(param, name)
    stale = value is None or value is optimizer._consumed.get(param, {}).get(name)
    diagonal = state.get("fallback_diagonal") if stale else None
    if diagonal is None:
        diagonal = optimizer._read(update, name, writer.__name__, None)
    update.checks.append((f"`{name}`", diagonal))
    return diag_precondition(grad, diagonal, damping), {"fallback_diagonal": diagonal}
