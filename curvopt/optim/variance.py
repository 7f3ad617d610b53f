"""``VarianceAdaptedSGD``: element-wise variance adaptation (M-SVAG, Balles & Hennig 2018)."""

from __future__ import annotations

import torch

from dataclasses import dataclass
from typing import ClassVar

from curvopt.optim.base import CurvatureOptimizer, ParamUpdate
from curvopt.optim.options import CurvatureOptions, number, option
from curvopt.optim.transforms import add_weight_decay


@dataclass(frozen=True)
class VarianceAdaptedOptions(CurvatureOptions):
    """``lr``, ``weight_decay`` and the momentum ``β ∈ [0, 1)`` of M-SVAG."""

    POSITIONAL: ClassVar[tuple[str, ...]] = ("lr", "momentum", "weight_decay")

    momentum: float = option(0.0, number(0.0, 1.0, open_high=True))


class VarianceAdaptedSGD(CurvatureOptimizer):
    """SGD whose step is shrunk element-wise where the gradient is noisy.

    With ``g = ∇L + δ θ``, the exact mini-batch variance ``σ² = p.variance`` of the
    per-sample gradients (``Variance()``) and the batch size ``N`` (from ``BatchL2Grad()``),
    the variance of the mini-batch gradient is estimated (for either loss reduction) as
    ``s = N² / (N − 1) · σ²`` (0 when ``N = 1``). At step ``t = 1, 2, ...``, with momentum ``β``::

        m̃ ← β m̃ + (1 − β) g,     m = m̃ / (1 − βᵗ)                 (bias-corrected mean)
        ρ = (1 − β)(1 + βᵗ) / ((1 + β)(1 − βᵗ))                     (variance factor of m)
        γ = m² / (m² + ρ s)       (γ = 1 where m² + ρ s = 0)
        θ ← θ − lr · γ ⊙ m

    With ``β = 0`` (default) this is SVAG, ``θ ← θ − lr · g²/(g² + s) ⊙ g``; with ``β > 0`` it
    is M-SVAG. When all per-sample gradients agree, ``s = 0`` and ``γ = 1``: the step is SGD's
    (``torch.optim.SGD(lr)`` for ``β = 0``, SGD on the bias-corrected average ``m`` otherwise).

    Args:
        params: parameters or param groups, as for ``torch.optim.SGD``.
        lr: learning rate ``≥ 0``.
        momentum: ``β ∈ [0, 1)``.
        weight_decay: ``δ ≥ 0`` (added to the gradient; it has no variance).
    """

    Options = VarianceAdaptedOptions

    def _needs(self, group, group_state):
        return [("variance", {}), ("batch_l2", {})]

    def _plan_group(self, group, group_state, with_model):
        beta = group["momentum"]
        updates = []
        for index, param in enumerate(group["params"]):
            if self._unused(param, ("variance", "batch_l2")):
                continue
            state = self.state.get(param, {})
            update = ParamUpdate(param, self._describe(group, index, param))
            variance = self._read(update, "variance", "Variance", None)
            batch_l2 = self._read(update, "batch_l2", "BatchL2Grad", None)
            update.checks += [("gradient", param.grad), ("`variance`", variance)]
            n = batch_l2.shape[0]
            noise = variance * (n * n / (n - 1)) if n > 1 else torch.zeros_like(variance)

            grad = add_weight_decay(self._grad(param), param, group["weight_decay"])
            t = state.get("step", 0) + 1
            average = grad * (1 - beta) if t == 1 else torch.lerp(grad, state["exp_avg"], beta)
            mean = average / (1 - beta**t)
            rho = (1 - beta) * (1 + beta**t) / ((1 + beta) * (1 - beta**t))
            signal = mean * mean
            total = signal + rho * noise
            gain = torch.where(total > 0, signal / torch.where(total > 0, total, 1), 1)
            update.delta = group["lr"] * gain * mean
            update.checks.append(("update", update.delta))
            if beta > 0:
                update.state = {"step": t, "exp_avg": average}
            updates.append(update)
        return updates, 0.0
