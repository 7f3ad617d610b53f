"""``d ← d + δθ`` after the preconditioner (``weight_decay`` δ; no stage for ``δ = 0``): weight
decay decoupled from the gradient, as ``torch.optim.AdamW`` (Loshchilov & Hutter 2019), so that
with the learning-rate stage ``θ ← θ − lr (d + δθ) = (1 − lr δ) θ − lr d``: the decay is not
rescaled by the preconditioner, as ``AddWeightDecay``'s ``g + δθ`` is."""

from __future__ import annotations

from curvopt.optim.stages.base import GroupStep, Stage


class DecoupledWeightDecay(Stage):
    """``d ← d + δθ`` of every parameter, in place where the step owns ``d``.

    Example:
        >>> from curvopt.optim import EigenAdam, stages
        >>> isinstance(EigenAdam.stages.stages[3], stages.DecoupledWeightDecay)
        True
    """

    order = 55
    identity_at = ("weight_decay", 0)

    def __call__(self, step: GroupStep) -> None:
        weight_decay = step.group["weight_decay"]
        for item in step.params:
            param = item.update.param.detach()
            if item.owns(item.direction):
                item.direction.add_(param, alpha=weight_decay)
            else:
                item.direction = item.own = item.direction.add(param, alpha=weight_decay)
