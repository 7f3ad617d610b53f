"""``DiagGGNNewton``: damped Newton steps with the diagonal of the GGN."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from curvopt.inversion.diagonal import diag_quadratic
from curvopt.inversion.inverses import DiagonalInverse
from curvopt.optim.newton import NewtonOptimizer
from curvopt.optim.options import NewtonOptions, choice, option

#: ``curvature=`` -> the attribute its extension writes (``curvopt.extensions.writer``)
_ATTRS = {"mc": "diag_ggn_mc", "exact": "diag_ggn_exact"}


@dataclass(frozen=True)
class DiagGGNOptions(NewtonOptions):
    """:class:`NewtonOptions` with ``curvature="mc" | "exact"``."""

    MONTE_CARLO = "mc"
    curvature: str = option("mc", choice(*_ATTRS))


class DiagGGNNewton(NewtonOptimizer):
    """``θ ← θ − lr · (diag(G) + (λ + δ) I)⁻¹ (∇L + δ θ)``, element-wise.

    Args:
        params: parameters or param groups, as for ``torch.optim.SGD``.
        lr: learning rate ``≥ 0``.
        damping: ``λ``: ``None`` (default: ``λ = α s`` as for :class:`KFAC`, ``α = 1e-2``,
            ``s`` the loss's reduction scale; :class:`ReductionScaledDamping`), or an absolute
            one: a number ``≥ 0``, a callable of the step count, or a damping strategy
            (:class:`ConstantDamping`, :class:`ScheduledDamping`, :class:`LevenbergMarquardt`).
        relative_damping: ``None`` (default) or ``α``: ``damping=None`` is then relative,
            ``λ = α m``, ``m`` the diagonals' mean at the first refresh (the former default,
            ``α = 1``; :class:`RelativeDamping`).
        curvature: ``"mc"`` (``DiagGGNMC``, ``p.diag_ggn_mc``) or ``"exact"``
            (``DiagGGNExact``, ``p.diag_ggn_exact``).
        weight_decay: ``δ ≥ 0`` (added to the gradient and to the damping).
        mc_samples: Monte-Carlo samples for ``curvature="mc"``.
        kl_clip: ``κ``: a trust region for every step, ``1e-3`` by default (``None``: the
            paper's update): the step is scaled by ``ν = min(1, sqrt(κ / (lr² gᵀ d)))``, ``d``
            the damped direction, so its length in the damped curvature (a proxy for the KL
            divergence it causes) is at most ``κ``; it makes small dampings such as ``1e-3``
            train.
            See :mod:`curvopt.optim.newton`.
        momentum, curvature_ema, fallback: see :mod:`curvopt.optim.newton` (off by default).
        curvature_interval: as for :class:`KFAC` (``None``: 10 under the default damping, 1
            with a damping given).
        process_group: under ``torch.distributed``: ``None`` (the default group if initialized
            with several ranks), a ``ProcessGroup``, a ``DistributedCurvature``, or ``False``
            (rank-local); see :mod:`curvopt.optim.distributed`.
        curvature_samples: must stay ``None``: the diagonals have no sub-batch form (another
            value raises ``ValueError``).
        schedule_free: ``None`` (default) or ``β ∈ (0, 1)``: schedule-free averaging; the
            parameters hold the point where the gradient is taken, ``opt.eval()`` and
            ``opt.train()`` switch them to the average and back (a ``step()`` in between
            raises). Does not combine with adaptive damping.
        orthogonalize, orthogonalize_dtype: Muon's orthogonalised steps; see
            :class:`~curvopt.optim.KFAC` (off by default).
        collection: ``"auto"`` (default: collect what the next step needs on every backward
            pass that reaches the optimizer's parameters) or ``"explicit"`` (only inside
            ``opt.collect()`` or ``opt.step(closure)``).
        stages: ``None`` (default: the chain ``curvopt.optim.stages.NEWTON``) or a
            ``curvopt.optim.stages.Chain`` that replaces it.

    Raises:
        ValueError: (at construction) an invalid hyper-parameter: negative ``lr`` or
            ``damping``, an unknown ``curvature``, options that do not fit together.
        FloatingPointError: (at ``step``) a gradient, curvature, update or resulting
            parameter is not finite; nothing is changed.

    Example:
        >>> import torch, curvopt
        >>> _ = torch.manual_seed(0)
        >>> model = curvopt.extend(torch.nn.Sequential(torch.nn.Linear(3, 2)))
        >>> lossfunc = torch.nn.CrossEntropyLoss()  # extended or not
        >>> X, y = torch.randn(16, 3), torch.randint(0, 2, (16,))
        >>> opt = curvopt.optim.DiagGGNNewton(model.parameters(), lr=0.1, damping=1e-3)
        >>> before = lossfunc(model(X), y).item()
        >>> for _ in range(5):
        ...     opt.zero_grad()
        ...     lossfunc(model(X), y).backward()  # the optimizer collects what it needs
        ...     opt.step()
        >>> lossfunc(model(X), y).item() < before
        True
    """

    Options = DiagGGNOptions

    def _extension(self, group):
        return _ATTRS[group["curvature"]], {"mc_samples": group["mc_samples"]}

    def _check_curvature(self, curvature, param):
        if not isinstance(curvature, torch.Tensor) or curvature.shape != param.shape:
            raise ValueError(
                f"expected a diagonal curvature tensor of shape {tuple(param.shape)}, got "
                f"{getattr(curvature, 'shape', type(curvature))}"
            )

    def _direction(self, item, step):
        return DiagonalInverse(item.curvature, step.damping).apply_one(item.grad), {}

    def _directions(self, items, step):
        """``g / (c + λ)`` of every dense gradient by two ``torch._foreach`` calls (the same
        element-wise operations: the same bits), a sparse one by :meth:`_direction`."""
        dense = [item for item in items if not item.grad.is_sparse]
        quotients = iter(())
        if dense:
            shifted = torch._foreach_add([item.curvature for item in dense], step.damping)
            quotients = iter(torch._foreach_div([item.grad for item in dense], shifted))
        return [
            self._direction(item, step) if item.grad.is_sparse else (next(quotients), {})
            for item in items
        ]

    def _quadratic(self, curvature, step):
        return diag_quadratic(curvature, step)
