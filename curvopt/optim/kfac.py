"""``KFAC``: damped Newton steps with Kronecker-factored curvature ``B ⊗ A``."""

from __future__ import annotations

from dataclasses import dataclass

import weakref

import torch
from torch import nn

from curvopt import extensions
from curvopt.params import EXTENDED
from curvopt.optim.cache import cached
from curvopt.optim.fallback import fallback_diagonal
from curvopt.optim.gradient_factors import FactorCapture, factored_cheaper, reproduces
from curvopt.optim.kronecker import (
    as_matrix,
    exact_damped_solve,
    kron_cholesky_solve,
    kron_eigh,
    kron_quadratic,
    kron_solve,
    trace_norm_cholesky,
    trace_norm_solvers,
)
from curvopt.optim.newton import Derived, NewtonOptimizer
from curvopt.optim.options import NewtonOptions, choice, number, option

#: the curvatures, by the attribute their extension writes (``curvopt.extensions.writer``)
_CURVATURES = ("kfac", "kflr", "kfra")


@dataclass(frozen=True)
class KFACOptions(NewtonOptions):
    """:class:`NewtonOptions` with KFAC's curvatures, ``fallback='diagonal'``, and the
    options of its inverses."""

    curvature: str = option("kfac", choice(*_CURVATURES))
    fallback: str | None = option(None, choice(None, "sgd", "diagonal"))
    kronecker_damping: str = option("trace_norm", choice("trace_norm", "exact"))
    inverse_interval: int = option(1, number(1, integer=True))


class KFAC(NewtonOptimizer):
    """``θ ← θ − lr · (B ⊗ A + (λ + δ) I)⁻¹ (∇L + δ θ)`` with factors ``p.<curvature>``.

    The gradient of a weight ``[out, in, *k]`` is handled as ``G = grad.reshape(out, -1)``;
    ``(B ⊗ A)⁻¹ vec(G) = vec(B⁻¹ G A⁻¹)``. A bias (factors ``[B]``) uses ``(B + (λ + δ) I)⁻¹``.

    Args:
        params: parameters or param groups, as for ``torch.optim.SGD``.
        lr: learning rate ``≥ 0``.
        damping: ``λ``: a number ``≥ 0``, a callable of the step count, or a damping strategy.
        curvature: ``"kfac"`` (MC-sampled), ``"kflr"`` (exact loss Hessian) or ``"kfra"``.
        weight_decay: ``δ ≥ 0`` (added to the gradient and to the damping).
        kronecker_damping: ``"trace_norm"`` (default): ``(B + √λ/π I)⁻¹ G (A + π√λ I)⁻¹`` with
            ``π = sqrt((tr A/dim A)/(tr B/dim B))`` (Martens & Grosse 2015, Sec. 6.3);
            ``"exact"``: ``(B ⊗ A + λ I)⁻¹`` through eigendecompositions of ``B`` and ``A``.
        inverse_interval: recompute the inverses (Woodbury for low-rank factors; dense ones as
            Cholesky factors applied by triangular solves, or, when ``inverse_interval`` or
            ``curvature_interval`` is above 1 so that they are reused, as inverses applied by
            matrix products) or eigendecompositions at most every ``m``
            steps, reusing them in between (default 1: whenever curvature or damping changed).
        mc_samples: Monte-Carlo samples for ``curvature="kfac"``.
        kl_clip: ``κ``: a trust region for every step, ``1e-3`` by default (``None``: the
            paper's update): the step is scaled by ``ν = min(1, sqrt(κ / (lr² gᵀ d)))``, ``d``
            the damped direction, so its length in the damped curvature (a proxy for the KL
            divergence it causes) is at most ``κ``; it makes small dampings such as ``1e-3``
            train.
        fallback: for parameters without Kronecker factors (a ViT's class token and position
            embeddings): ``None`` (default: raise, naming them), ``"sgd"`` (the plain gradient)
            or ``"diagonal"`` (the damped diagonal Newton step with the diagonal of the same
            curvature, :mod:`curvopt.optim.fallback`); with either, the backward pass skips
            their Kronecker factors (``collect(skip_unsupported=True / "diagonal")``).
        momentum, curvature_ema, curvature_interval: see
            :mod:`curvopt.optim.newton` (all off by default).
        process_group: under ``torch.distributed``: ``None`` (the default group if initialized
            with several ranks), a ``ProcessGroup``, a ``DistributedCurvature``, or ``False``
            (rank-local); see :mod:`curvopt.optim.distributed`.
    """

    Options = KFACOptions

    def _collect_options(self):
        fallbacks = {g["fallback"] for g in self.param_groups}
        if "diagonal" in fallbacks:
            return {"skip_unsupported": "diagonal"}
        return {"skip_unsupported": fallbacks != {None}}

    def _fallback_direction(self, update, grad, state, group, damping):
        if group["fallback"] != "diagonal":
            return super()._fallback_direction(update, grad, state, group, damping)
        attr, _ = self._extension(group)
        extension = extensions.writer(attr).__name__
        return fallback_diagonal(self, update, grad, state, attr, extension, damping)

    def _extension(self, group):
        return group["curvature"], {"mc_samples": group["mc_samples"]}

    def _check_curvature(self, curvature, param):
        if not isinstance(curvature, (list, tuple)) or not all(
            isinstance(f, torch.Tensor) and f.dim() == 2 and f.shape[0] == f.shape[1]
            for f in curvature
        ):
            raise ValueError(f"expected a list of square Kronecker factors, got {curvature!r}")
        as_matrix(param, curvature)

    def _derived(self, curvature, group, damping, curvature_step):
        interval = group["inverse_interval"]
        if group["kronecker_damping"] == "exact":
            return Derived(
                "eigh",
                curvature_step,
                interval,
                lambda: kron_eigh(curvature),
                lambda: [(f.new_empty(f.shape[0]), torch.empty_like(f)) for f in curvature],
            )
        # a product with a dense inverse runs ~2x faster than two triangular solves, and forming
        # the inverse costs ~2x the Cholesky factorisation: worth it when it is applied again
        reused = max(interval, group["curvature_interval"]) > 1
        # Woodbury needs each rank's own roots: off when inverses are spread over ranks
        low_rank = self._distributed is None
        build = trace_norm_solvers if reused else trace_norm_cholesky
        return Derived(
            "inverse" if reused else "cholesky",
            (curvature_step, damping),
            interval,
            lambda: build(curvature, damping, low_rank=low_rank),
            lambda: [torch.empty_like(f) for f in curvature],
        )

    def _direction(
        self, grad, curvature, state, group, step, damping, curvature_step, factors=None
    ):
        matrix = as_matrix(grad, curvature)
        derived = self._derived(curvature, group, damping, curvature_step)
        entry = cached(
            state.get(derived.name), derived.key, step, derived.interval, derived.compute
        )
        if derived.name == "eigh":
            direction = exact_damped_solve(entry["value"], matrix, damping)
        else:
            apply = kron_cholesky_solve if derived.name == "cholesky" else kron_solve
            direction = _factored(apply, entry["value"], matrix, factors)
            if direction is None:
                direction = apply(entry["value"], matrix)
        return direction.reshape(grad.shape), {derived.name: entry}

    # ----------------------------------------------------------------- factored steps
    def collect(self):
        """As :meth:`CurvatureOptimizer.collect`; also watches the dense layers whose steps
        may be applied in factored form from the next forward on (``gradient_factors``)."""
        if self not in _CAPTURES:
            capture = _CAPTURES[self] = FactorCapture()
            weights = {id(p) for g in self.param_groups for p in g["params"]}
            for module in list(EXTENDED):
                if isinstance(module, nn.Linear) and id(module.weight) in weights:
                    capture.watch(self, module)
        return super().collect()

    def step(self, closure=None):
        """As :meth:`CurvatureOptimizer.step`; the captured layer factors are dropped after."""
        try:
            return super().step(closure)
        finally:
            if self in _CAPTURES:
                _CAPTURES[self].clear()

    def _gradient_factors(self, param):
        capture = _CAPTURES.get(self)
        return None if capture is None else capture.factors(param)

    def _quadratic(self, curvature, step):
        return kron_quadratic(curvature, as_matrix(step, curvature))


#: optimizer -> its FactorCapture (kept outside the optimizer, which stays picklable)
_CAPTURES: "weakref.WeakKeyDictionary[KFAC, FactorCapture]" = weakref.WeakKeyDictionary()


def _factored(apply, solvers, matrix, factors):
    """``(B⁻¹ bᵀ)(A⁻¹ aᵀ)ᵀ`` where that is cheaper and ``factors = (a, b)`` give ``matrix``
    (``gradient_factors``), else None."""
    if factors is None or len(solvers) != 2:
        return None
    a, b = factors
    if not factored_cheaper(solvers, *matrix.shape, len(a)) or not reproduces(matrix, factors):
        return None
    left = apply(solvers[:1], b.mT.to(matrix.dtype))
    right = apply(solvers[1:], a.mT.to(matrix.dtype))
    return left @ right.mT
