"""``EKFAC``: damped Newton steps in KFAC's eigenbasis with eigenvalues corrected every step.

George et al. (2018), "Fast Approximate Natural Gradient Descent in a Kronecker-factored
Eigenbasis". Per parameter, with the basis ``Q = Q_B ⊗ Q_A`` of its Kronecker factors and the
corrected eigenvalues ``S`` (:mod:`curvopt.optim.eigen_corrected`)::

    d = Q [(Qᵀ g) ⊘ (vec S + λ + δ)]   = vec(Q_B [(Q_Bᵀ G Q_A) / (S + λ + δ)] Q_Aᵀ)

The basis is refreshed from the factors every ``basis_interval`` steps (an eigendecomposition
of each factor); ``S`` is recomputed from the per-sample gradients ``grad_batch`` of every
curvature step (every step by default), in the current basis.
"""

from __future__ import annotations


from dataclasses import dataclass

from curvopt.optim.eigen_corrected import (
    as_rows,
    eigen_correction,
    eigen_corrected_quadratic,
    eigen_corrected_solve,
    kron_basis,
)
from curvopt.optim.kronecker import as_matrix
from curvopt.optim.newton import NewtonOptimizer
from curvopt.optim.options import NewtonOptions, choice, number, option

#: the factors' curvatures, by the attribute their extension writes
_FACTORS = ("kfac", "kflr")


@dataclass(frozen=True)
class EKFACOptions(NewtonOptions):
    """:class:`NewtonOptions` with the factors' curvatures, the loss reduction and the basis
    interval; ``curvature_ema`` is fixed at 0 (not a constructor keyword)."""

    curvature: str = option("kfac", choice(*_FACTORS))
    curvature_ema: float = option(0.0, number(0.0, 1.0, open_high=True), keyword=False)
    reduction: str = option("mean", choice("mean", "sum"))
    basis_interval: int = option(1, number(1, integer=True))

    def relations(self) -> None:
        if self.curvature_ema != 0:
            raise ValueError(
                "EKFAC does not support curvature_ema: S is recomputed in the current basis "
                "at every curvature step"
            )
        if self.basis_interval % self.curvature_interval:
            raise ValueError(
                f"basis_interval ({self.basis_interval}) must be a multiple of "
                f"curvature_interval ({self.curvature_interval}): the basis is refreshed "
                "at curvature steps"
            )


class EKFAC(NewtonOptimizer):
    """``θ ← θ − lr · (Q diag(S) Qᵀ + (λ + δ) I)⁻¹ (∇L + δ θ)``, ``Q`` the eigenbasis of the
    Kronecker factors ``p.<curvature>``, ``S`` the corrected eigenvalues.

    ``S = c · Σ_n (Q_Bᵀ G_n Q_A)²`` with ``G_n = grad_batch[n].reshape(out, -1)`` and ``c = N``
    for ``reduction="mean"``, ``c = 1`` for ``"sum"``, so that ``vec S = diag(Qᵀ EF Q)`` for
    the empirical Fisher ``EF`` of the batch scaled like the GGN (``API.md``): ``Q diag(S) Qᵀ``
    is the projection of ``EF`` onto the matrices diagonal in ``Q``. This holds for any
    parameter that has ``grad_batch``: with weight sharing (convolutions, sequences) ``G_n`` is
    the per-sample gradient summed over the shared positions, so ``S`` is the diagonal of the
    *per-sample* empirical Fisher in the basis (the basis itself is KFAC's approximation). A
    parameter that gets ``grad_batch`` but no (fresh) Kronecker factors at a basis step keeps
    its current basis, the identity if it never had factors (a module the factors do not
    cover): ``S`` is then the diagonal of the empirical Fisher.

    Limitation: ``S`` is computed from ``grad_batch`` (extension ``BatchGrad``), so every
    curvature step materialises the per-sample gradients (``N × numel`` per parameter) and
    rotates them (``N (out² · in·k + out · (in·k)²)`` flops per weight).

    Args:
        params: parameters or param groups, as for ``torch.optim.SGD``.
        lr: learning rate ``≥ 0``.
        damping: ``λ``: a number ``≥ 0``, a callable of the step count, or a damping strategy.
        curvature: the factors giving the basis: ``"kfac"`` (MC-sampled) or ``"kflr"``.
        weight_decay: ``δ ≥ 0`` (added to the gradient and to the damping).
        reduction: ``"mean"`` or ``"sum"``, that of the loss whose backward pass fills
            ``grad_batch`` (it fixes the scale ``c`` of ``S``; ``grad_batch`` does not show it).
        basis_interval: refresh the basis every ``k`` steps (a multiple of
            ``curvature_interval``); in between ``S`` is still recomputed in the old basis.
        mc_samples: Monte-Carlo samples for ``curvature="kfac"``.
        momentum, curvature_interval, kl_clip, fallback: see :class:`~curvopt.optim.KFAC`
            and :mod:`curvopt.optim.newton`. ``curvature_ema`` is not supported (``S`` of an
            old basis cannot be averaged with one of a new basis).
    """

    _distributable = False  # torch.distributed raises NotImplementedError (not wired up yet)

    Options = EKFACOptions
    #: what ``_plan_group`` passes to ``_read`` while it runs
    _planning: dict | None = None

    # ----------------------------------------------------------------- what to collect
    def _extension(self, group):
        return "grad_batch", {}

    def _factor_extension(self, group):
        return group["curvature"], {"mc_samples": group["mc_samples"]}

    def _basis_due(self, group, step: int) -> bool:
        return step % group["basis_interval"] == 0

    def _needs(self, group, group_state):
        needs = super()._needs(group, group_state)
        lacking = any(self._lacks_curvature(group, p) for p in group["params"] if p.requires_grad)
        if needs and (self._basis_due(group, group_state["step"]) or lacking):
            needs.append(self._factor_extension(group))
        return needs

    # ----------------------------------------------------------------- reading
    def _plan_group(self, group, group_state, with_model):
        """The base plan, with ``_read`` turning ``grad_batch`` (and fresh factors) into the
        curvature ``[S, *bases]``; each update records the objects it actually read."""
        self._planning = {"group": group, "step": group_state["step"], "read": {}}
        try:
            updates, predicted = super()._plan_group(group, group_state, with_model)
            read = self._planning["read"]
        finally:
            self._planning = None
        for update in updates:
            if update.param in read:
                update.consumed = read[update.param]
        return updates, predicted

    def _read(self, param, attr, description, extension, fallback):
        """``[S, *bases]`` from ``grad_batch``, in the basis of fresh factors when the basis is
        due (or the parameter has none yet), else in the parameter's current basis."""
        grad_batch = super()._read(param, attr, description, extension, fallback)
        if grad_batch is None:
            return None
        group, step = self._planning["group"], self._planning["step"]
        read = {attr: getattr(param, attr)}
        old = self.state.get(param, {}).get("curvature")
        bases = [] if old is None else list(old[1:])
        if old is None or self._basis_due(group, step):
            factor_attr, _ = self._factor_extension(group)
            factors = getattr(param, factor_attr, None)
            if factors is not None and factors is not self._consumed.get(param, {}).get(
                factor_attr
            ):
                read[factor_attr] = factors
                bases = self._basis(param, factor_attr, factors, description)
        self._planning["read"][param] = read
        scale = grad_batch.shape[0] if group["reduction"] == "mean" else 1
        return [eigen_correction(grad_batch, bases, scale), *bases]

    def _basis(self, param, attr, factors, description):
        factors = self._unscaled(attr, factors)
        try:
            as_matrix(param, factors)
        except ValueError as error:
            raise ValueError(f"{description}: {error}") from None
        for index, factor in enumerate(factors):
            if not bool(factor.isfinite().all()):
                raise FloatingPointError(
                    f"the `{attr}` factor {index} of {description} is not finite; no parameter "
                    "was updated. Check the loss and the learning rate, or increase the damping."
                )
        return kron_basis(factors)

    # ----------------------------------------------------------------- the step
    def _direction(
        self, grad, curvature, state, group, step, damping, curvature_step, factors=None
    ):
        correction, bases = curvature[0], curvature[1:]
        direction = eigen_corrected_solve(bases, correction, as_rows(grad, bases), damping)
        return direction.reshape(grad.shape), {}

    def _quadratic(self, curvature, step):
        correction, bases = curvature[0], curvature[1:]
        return eigen_corrected_quadratic(bases, correction, as_rows(step, bases))
