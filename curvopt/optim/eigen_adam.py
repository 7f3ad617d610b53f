"""``EigenAdam``: Adam in the eigenbasis of KFAC's Kronecker factors (SOAP with bases from the
backward pass).

SOAP (Vyas et al. 2024) runs Adam in the eigenbasis of Shampoo's factors ``G Gᵀ`` and
``Gᵀ G``, accumulated from the gradients of past steps. ``EigenAdam`` takes the basis from the
Kronecker factors the backward pass computes (``p.kfac``, Monte-Carlo, or ``p.kflr``), averaged
over steps, so it has one from the first step on. Per weight with factors ``[B, A]``::

    B̄ ← β B̄ + (1 − β) B,  Ā ← β Ā + (1 − β) A       curvature_ema β  (stage 20)
    every basis_interval steps: Q_B, Q_A = eigenvectors of B̄, Ā;
        m, v carried into the new basis               (stage 25, stages.eigenbasis)
    G' = Q_Bᵀ G Q_A;  Adam's m, v, bias correction     (stage 30, stages.eigenbasis_adam)
    d = Q_B [m̂ / (sqrt(v̂) + ε)] Q_Aᵀ
    d ← d + δ θ                                        weight_decay δ, decoupled (stage 55)
    Δ = lr · d;  θ ← θ − Δ                             (stage 60; schedule-free: stage 70)

A bias (factors ``[B]``) is rotated on one side; a parameter without factors steps as
``torch.optim.Adam`` (``fallback="adam"``); ``basis="identity"`` collects nothing and steps
every parameter as ``torch.optim.AdamW``.
"""

from __future__ import annotations

from dataclasses import dataclass

from curvopt.optim.kfac import KFAC
from curvopt.optim.newton import NewtonOptimizer
from curvopt.optim.options import (
    BASIS_REFRESH,
    KFAC_APPROX,
    NewtonOptions,
    check_number,
    choice,
    number,
    option,
    optional,
)
from curvopt.optim.stages import EIGEN_ADAM


def _betas(name: str, value) -> None:
    if not (isinstance(value, (tuple, list)) and len(value) == 2):
        raise ValueError(f"{name} must be a pair (beta1, beta2), got {value!r}")
    for index, beta in enumerate(value):
        check_number(f"{name}[{index}]", beta, 0.0, 1.0, open_high=True)


@dataclass(frozen=True)
class EigenAdamOptions(NewtonOptions):
    """:class:`NewtonOptions` with Adam's ``betas`` and ``eps``, the basis (``basis``,
    ``basis_interval``, ``max_basis_dim``) and its factors (``curvature``, ``kfac_approx``,
    ``mc_samples``, ``curvature_ema``); the damping, momentum and trust region of the Newton
    step are fixed off (not constructor keywords)."""

    POSITIONAL = ("lr", "betas", "eps", "weight_decay")

    lr: float = option(1e-3, number())
    betas: tuple[float, float] = option((0.95, 0.95), _betas)
    eps: float = option(1e-8, number())
    basis: str = option("kronecker", choice("kronecker", "identity"))
    basis_interval: int = option(10, number(1, integer=True))
    max_basis_dim: int | None = option(None, optional(number(1, integer=True)))
    basis_refresh: str = option("eigh", choice(*BASIS_REFRESH))
    MONTE_CARLO = "kfac"
    curvature: str = option("kfac", choice("kfac", "kflr"))
    curvature_ema: float = option(0.95, number(0.0, 1.0, open_high=True))
    curvature_interval: int = option(1, number(1, integer=True))
    kfac_approx: str = option("expand", choice(*KFAC_APPROX))
    fallback: str | None = option("adam", choice(None, "adam"))
    damping: float = option(0.0, choice(0.0), keyword=False)
    relative_damping: float = option(0.0, choice(0.0), keyword=False)
    momentum: float = option(0.0, choice(0.0), keyword=False)
    kl_clip: float | None = option(None, choice(None), keyword=False)


class EigenAdam(NewtonOptimizer):
    """Adam(W) whose moments live in the eigenbasis ``Q_B ⊗ Q_A`` of each weight's averaged
    Kronecker factors ``p.<curvature>``, the basis refreshed every ``basis_interval`` steps.

    Per weight, ``G = grad.reshape(dim B, -1)`` (``[dim B, 1]`` for a bias with ``[B]``), ``t``
    its step count (see :mod:`curvopt.optim.eigen_adam` for the chain of stages)::

        G' = Q_Bᵀ G Q_A,   m ← β1 m + (1 − β1) G',   v ← β2 v + (1 − β2) G'²
        θ ← θ − lr · (Q_B [m̂ / (sqrt(v̂) + ε)] Q_Aᵀ + δ θ),  m̂ = m / (1 − β1ᵗ), v̂ = v / (1 − β2ᵗ)

    When the basis changes, ``m`` is rotated into the new one exactly and ``v`` projected
    (:mod:`curvopt.optim.stages.eigenbasis`). With the identity basis (``basis="identity"``) the
    step is ``torch.optim.AdamW``'s (``torch.optim.Adam``'s for ``weight_decay=0``).

    Args:
        params: parameters or param groups, as for ``torch.optim.AdamW``.
        lr: learning rate ``≥ 0`` (default ``1e-3``).
        betas: ``(β1, β2)``, Adam's moment decays, each in ``[0, 1)``; ``(0.95, 0.95)`` by
            default, SOAP's: a short memory of ``v``, whose basis changes.
        eps: ``ε`` added to ``sqrt(v̂)`` (default ``1e-8``).
        weight_decay: ``δ ≥ 0``, decoupled as in ``AdamW`` (default 0).
        basis: ``"kronecker"`` (default: the factors' eigenbasis) or ``"identity"`` (no
            curvature collected: ``torch.optim.AdamW``'s step).
        basis_interval: refresh the basis every ``k`` steps (default 10, SOAP's
            ``precondition_frequency``); the factors are averaged at every curvature step.
        max_basis_dim: ``None`` (default: every side rotated) or ``m``: a side wider than ``m``
            keeps the identity basis and its factor is never eigendecomposed.
        basis_refresh: ``"eigh"`` (default: each refresh eigendecomposes the factors) or
            ``"warm"`` (the first refresh does; the later ones take one power step from the
            last basis and a QR, SOAP's refresh, :mod:`curvopt.inversion.warm_eigh`).
        curvature: the factors: ``"kfac"`` (default, Monte-Carlo sampled) or ``"kflr"`` (exact).
        curvature_ema: ``β`` of the factors' average (default 0.95, SOAP's ``shampoo_beta``).
        curvature_interval: read the factors every ``k`` steps (default 1).
        kfac_approx, mc_samples, curvature_samples: the factors' options, as for
            :class:`~curvopt.optim.KFAC`.
        fallback: for parameters without Kronecker factors: ``"adam"`` (default: Adam in the
            identity basis, announced once) or ``None`` (raise, naming them).
        schedule_free: ``β``: schedule-free averaging of the steps (``None``: off); evaluate
            after ``opt.eval()``. Pair it with ``betas=(0.0, β2)`` or ``(0.9, β2)``.

    Returns:
        ``step()`` returns the closure's loss, or ``None``.

    Example:
        >>> import curvopt, torch
        >>> model = curvopt.extend(torch.nn.Linear(3, 2))
        >>> opt = EigenAdam(model.parameters(), lr=1e-2, basis_interval=5)
        >>> loss = curvopt.extend(torch.nn.MSELoss())(model(torch.randn(4, 3)), torch.zeros(4, 2))
        >>> loss.backward()
        >>> opt.step()
    """

    _distributable = False  # torch.distributed raises NotImplementedError (not wired up yet)

    Options = EigenAdamOptions
    stages = EIGEN_ADAM
    _remedy = "Lower the learning rate (lr), or raise eps"

    def _extension(self, group):
        options = {"mc_samples": group["mc_samples"], "kfac_approx": group["kfac_approx"]}
        return group["curvature"], options

    def _needs(self, group, group_state):
        """The factors where due; none in the identity basis."""
        return [] if group["basis"] == "identity" else super()._needs(group, group_state)

    def _curvature_due(self, group, group_state):
        return group["basis"] != "identity" and super()._curvature_due(group, group_state)

    def _lacks_curvature(self, group, state):
        """A parameter with factors has them from its first step on (every group's first step
        reads them); one without is stepped by ``fallback="adam"`` and is never read again
        before its curvature step; with ``fallback=None`` a missing one raises when read."""
        if group["basis"] == "identity" or group["fallback"] == "adam":
            return False
        return "curvature" not in state

    def _check_curvature(self, curvature, param):
        KFAC._check_curvature(self, curvature, param)  # square factors of the parameter's size
