"""``KFAC``: damped Newton steps with Kronecker-factored curvature ``B ⊗ A``."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from curvopt.core.reductions import dense, diagonal
from curvopt.optim.fallback import DiagonalFallback
from curvopt.optim.gradient_factors import FactorCapture, factored_cheaper, reproduces
from curvopt.inversion.kronecker import InverseOptions, KroneckerInverse, as_matrix, kron_quadratic
from curvopt.optim.newton import Derived, NewtonOptimizer
from curvopt.optim.plan import (
    buckets,
    cached,
    refresh_interval,
    shape_key,
    stacked_matrices,
    unstacked,
)
from curvopt.inversion.trace_norm import eigh_solvers
from curvopt.optim.options import (
    KFAC_APPROX,
    KRONECKER_FALLBACKS,
    NewtonOptions,
    choice,
    number,
    option,
    optional,
)

#: the curvatures, by the attribute their extension writes (``curvopt.extensions.writer``)
_CURVATURES = ("kfac", "kflr", "kfra")


@dataclass(frozen=True)
class KFACOptions(NewtonOptions):
    """:class:`NewtonOptions` with KFAC's curvatures, ``fallback='diagonal'`` (the default),
    and the options of its inverses."""

    MONTE_CARLO = "kfac"
    curvature: str = option("kfac", choice(*_CURVATURES))
    fallback: str | None = option("diagonal", choice(*KRONECKER_FALLBACKS))
    kronecker_damping: str = option("trace_norm", choice("trace_norm", "trace_norm_eigh", "exact"))
    inverse_interval: int = option(1, number(1, integer=True))
    max_rank: int | None = option(None, optional(number(1, integer=True)))
    kfac_approx: str = option("expand", choice(*KFAC_APPROX))

    def relations(self) -> None:
        super().relations()
        if self.max_rank is not None and self.kronecker_damping == "exact":
            raise ValueError(
                "KFAC: max_rank caps the trace-norm inverses; it does not exist for "
                "kronecker_damping='exact' (use 'trace_norm' or 'trace_norm_eigh')"
            )
        if self.kfac_approx != "expand" and self.curvature == "kfra":
            raise ValueError(
                f"KFAC: kfac_approx={self.kfac_approx!r} does not exist for curvature='kfra' "
                "(KFRA propagates batch-averaged curvature and has no weight-sharing variant); "
                "use curvature='kfac' or 'kflr', or kfac_approx='expand'"
            )


class KFAC(DiagonalFallback, NewtonOptimizer):
    """``θ ← θ − lr · (B ⊗ A + (λ + δ) I)⁻¹ (∇L + δ θ)`` with factors ``p.<curvature>``.

    The gradient of a weight ``[out, in, *k]`` is handled as ``G = grad.reshape(out, -1)``;
    ``(B ⊗ A)⁻¹ vec(G) = vec(B⁻¹ G A⁻¹)``. A bias (factors ``[B]``) uses ``(B + (λ + δ) I)⁻¹``.

    Args:
        params: parameters or param groups, as for ``torch.optim.SGD``.
        lr: learning rate ``≥ 0``.
        damping: ``λ``: ``None`` (default: ``λ = α s``, ``α = 1e-2``, ``s`` the factor by
            which the loss's reduction scales one sample's curvature, re-read at every
            refresh, the trust region's ``κ`` scaled by ``s`` too;
            ``damping=ReductionScaledDamping(α), curvature_interval=10`` is the default with
            another ``α``), or an absolute one: a number ``≥ 0``, a callable of the step
            count, or a damping strategy; so ``KFAC(params, lr=0.1)`` trains (with the trust
            region ``kl_clip``).
        relative_damping: ``None`` (default) or ``α``: ``damping=None`` is then relative,
            ``λ = α m``, ``m`` the curvatures' mean eigenvalue at the first refresh
            (``RelativeDamping``).
        curvature: ``"kfac"`` (MC-sampled), ``"kflr"`` (exact loss Hessian) or ``"kfra"``.
        weight_decay: ``δ ≥ 0`` (added to the gradient and to the damping).
        kronecker_damping: ``"trace_norm"`` (default): ``(B + √λ/π I)⁻¹ G (A + π√λ I)⁻¹`` with
            ``π = sqrt((tr A/dim A)/(tr B/dim B))`` (Martens & Grosse 2015, Sec. 6.3);
            ``"trace_norm_eigh"``: the same split applied in the factors' eigenbases,
            ``(F + c I)⁻¹ = Q diag(1/(s + c)) Qᵀ`` (:mod:`curvopt.inversion.trace_norm`), so a
            new ``λ`` or ``π`` needs no new factorisation;
            ``"exact"``: ``(B ⊗ A + λ I)⁻¹`` through eigendecompositions of ``B`` and ``A``.
        inverse_interval: recompute the inverses (Woodbury for low-rank factors; dense ones as
            Cholesky factors applied by triangular solves, or, when ``inverse_interval`` or
            ``curvature_interval`` is above 1 so that they are reused, as inverses applied by
            matrix products) or eigendecompositions at most every ``m``
            steps, reusing them in between (default 1: whenever curvature or damping changed;
            with ``"trace_norm_eigh"`` and ``"exact"`` a new damping alone is applied to the
            cached decomposition at once).
        max_rank: ``None`` (default, exact) or ``k``: the trace-norm inverse of a factor wider
            than ``2k`` from its top ``k`` eigenpairs, ``(F_k + c I)⁻¹`` (the other directions
            see the damping only; an approximation), in the dense and the factored step.
        kfac_approx: ``"expand"`` (default) or ``"reduce"`` (Eschenhagen et al., 2023): how
            the factors of weight-sharing layers (convolutions, sequences) treat the shared
            positions, as in ``curvopt.extensions.KFAC``; not for ``"kfra"``.
        mc_samples: Monte-Carlo samples for ``curvature="kfac"``.
        kl_clip: ``κ``: a trust region for every step, ``1e-3`` by default (``None``: the
            paper's update): the step is scaled by ``ν = min(1, sqrt(κ / (lr² gᵀ d)))``, ``d``
            the damped direction, so its length in the damped curvature (a proxy for the KL
            divergence it causes) is at most ``κ``; it makes small dampings such as ``1e-3``
            train.
        fallback: for parameters without Kronecker factors (a ViT's class token and position
            embeddings, a weight used non-linearly): ``"diagonal"`` (default: the damped
            diagonal Newton step with the diagonal of the same curvature, ``p.kfac_diagonal``
            or ``p.kflr_diagonal``, on the scale of the Kronecker steps), ``"sgd"`` (the plain
            gradient) or ``None`` (raise, naming them); see :mod:`curvopt.optim.fallback`. With
            either of the first two the backward pass skips their Kronecker factors
            (``collect(skip_unsupported="diagonal" / True)``), and the first step that
            preconditions such parameters warns once, naming them.
        momentum, curvature_ema: see :mod:`curvopt.optim.newton` (off by default).
        curvature_interval: the curvature (and the inverses) every ``k`` steps, plain steps
            between (the hooks do nothing); ``None`` (default): 10 under the default damping,
            1 (every step) with a damping given.
        process_group: under ``torch.distributed``: ``None`` (the default group if initialized
            with several ranks), a ``ProcessGroup``, a ``DistributedCurvature``, or ``False``
            (rank-local); see :mod:`curvopt.optim.distributed`.
        curvature_samples: ``None`` (default: the whole batch) or ``K``: the Kronecker
            factors from the first ``K`` samples of each batch (as
            ``curvopt.extensions.KFAC(samples=K)``), their output side scaled to estimate the
            whole batch's.
        schedule_free: ``None`` (default) or ``β ∈ (0, 1)``: schedule-free averaging; the
            parameters hold the point where the gradient is taken, ``opt.eval()`` and
            ``opt.train()`` switch them to the average and back (a ``step()`` in between
            raises). Does not combine with adaptive damping.
        orthogonalize: ``True``: each matrix-shaped update (after momentum) replaced by its
            polar factor, by Newton–Schulz, as Muon's (``stages.orthogonalize``); take Muon's
            learning rates then. ``False`` by default.
        orthogonalize_dtype: the dtype of those Newton–Schulz iterations: ``None`` (default:
            the update's), a floating ``torch.dtype`` or its name; ``torch.bfloat16`` is
            Muon's, several times faster where bfloat16 has matrix units.
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
        >>> opt = curvopt.optim.KFAC(model.parameters(), lr=0.1, damping=1e-3)
        >>> before = lossfunc(model(X), y).item()
        >>> for _ in range(5):
        ...     opt.zero_grad()
        ...     lossfunc(model(X), y).backward()  # the optimizer collects what it needs
        ...     opt.step()
        >>> lossfunc(model(X), y).item() < before
        True
    """

    Options = KFACOptions
    #: the calls of the dense layers, for the factored step (``gradient_factors``): made at
    #: the first :meth:`collect`, never pickled (``Optimizer.__getstate__`` keeps the state only)
    _capture = None

    def _extension(self, group):
        options = {"mc_samples": group["mc_samples"]}
        if group["curvature"] != "kfra":  # KFRA has no weight-sharing variants
            options["kfac_approx"] = group["kfac_approx"]
        return group["curvature"], options

    def _check_curvature(self, curvature, param):
        if not isinstance(curvature, (list, tuple)) or not all(
            isinstance(f, torch.Tensor) and f.dim() in (2, 3) and f.shape[-2] == f.shape[-1]
            for f in curvature
        ):
            raise ValueError(
                "expected a list of square Kronecker factors (stacked per group [G, d, d] for "
                f"a grouped convolution), got {curvature!r}"
            )
        as_matrix(param, curvature)

    def _inverse_options(self, group) -> InverseOptions:
        # a product with a dense inverse is one matrix product where triangular solves are two,
        # and forming the inverse costs about as much again as the Cholesky factorisation:
        # worth it when it is applied again
        interval = refresh_interval(group["curvature_interval"], group["damping"])
        reused = max(group["inverse_interval"], interval) > 1
        # Woodbury needs each rank's own roots: off when inverses are spread over ranks
        low_rank = self._distributed is None
        if (
            not low_rank
            and group["max_rank"] is not None
            and group["kronecker_damping"] != "trace_norm_eigh"
        ):
            raise NotImplementedError(
                "KFAC: max_rank with kronecker_damping='trace_norm' under torch.distributed "
                "(rank-capped inverses are not broadcast); use kronecker_damping="
                "'trace_norm_eigh' or max_rank=None"
            )
        options = InverseOptions(group["kronecker_damping"], reused, low_rank, group["max_rank"])
        return options

    def _derived(self, curvature, group, damping, curvature_step, options=None):
        """As ``NewtonOptimizer``'s: the cached inverse; ``options`` the group's
        :meth:`_inverse_options` where known (:meth:`_directions` makes them once a step)."""
        options = self._inverse_options(group) if options is None else options
        damped = options.kind not in ("eigh", "trace_norm_eigh")  # the others hold for every λ
        return Derived(
            options.kind,
            (curvature_step, damping) if damped else curvature_step,
            group["inverse_interval"],
            lambda: KroneckerInverse.compute(curvature, damping, options),
            lambda: KroneckerInverse.empty(curvature, options),
        )

    def _directions(self, items, step):
        """The damped direction of each of ``items``; on an accelerator (:meth:`_batches`) the
        blocks whose dense cached inverses (``kind`` ``"inverse"``: ``curvature_interval`` or
        ``inverse_interval`` above 1) have equal shapes applied together,
        ``B⁻¹_stack @ G_stack @ A⁻¹_stack`` (``optim.plan.Stacks``);
        Cholesky factors, Woodbury forms, exact eigendecompositions, factors stacked per group
        and factored steps are applied one parameter at a time."""
        solved = self._inverses(items, step)
        out: list = [None] * len(items)
        if self._capture is not None:  # the factored steps first, each on its own
            for i, ((inverse, kept), item) in enumerate(zip(solved, items)):
                direction = self._factored(inverse, item)
                out[i] = None if direction is None else (direction.reshape(item.grad.shape), kept)
        keys = (
            [
                None if done is not None else self._bucket(inverse, item, step)
                for done, (inverse, _), item in zip(out, solved, items)
            ]
            if self._batching(items)
            else []
        )
        for key, at in buckets(keys).items():
            if len(at) > 1:  # (one alone: its own products, as always)
                grads = [items[i].grad for i in at]
                inverses = [solved[i][0].value for i in at]
                for i, direction in zip(at, self._batched(key, inverses, grads)):
                    out[i] = direction, solved[i][1]
        for i, ((inverse, kept), item) in enumerate(zip(solved, items)):
            if out[i] is None:
                out[i] = inverse.apply_one(item.grad), kept
        return out

    def _bucket(self, inverse, item, step):
        """The key of the blocks ``item`` is applied with (:meth:`_directions`), or None."""
        solvers, grad = inverse.value, item.grad
        if not self._batches(grad.device):  # (a CPU's: one at a time)
            return None
        if inverse.kind != "inverse" or len(inverse.rows) != 1 or grad.is_sparse:
            return None
        if not all(isinstance(s, torch.Tensor) and s.dim() == 2 for s in solvers):
            return None
        return id(step.group), shape_key(solvers), grad.dtype

    def _batched(self, key, inverses, grads):
        """``B⁻¹ G A⁻¹`` (``B⁻¹ G``) of every block of a bucket by one product per side, the
        stacked inverses kept until a refresh replaces them (:meth:`_stacks`)."""
        stacks = self._stacks()
        left, *right = [
            stacks.stacked((key, side), [value[side] for value in inverses])
            for side in range(len(inverses[0]))
        ]
        result = left @ stacked_matrices(grads, left.shape[-1], left.dtype)
        if right:
            result = result @ right[0]
        return unstacked(result, grads)

    def _inverses(self, items, step):
        """``(KroneckerInverse, cache entries to keep)`` of each of ``items`` (:meth:`_inverse`).
        Between refreshes they are those of the last step (``optim.plan.Prepared``, one entry
        for the group: while the items are of the very parameters, their entries the very
        objects in their state, and the damping, the group's inverse options, the curvature
        steps and the gradients' shapes, dtypes and devices are the same), so that a plain
        step re-derives nothing and looks up once, not once per parameter."""
        if not items:
            return []
        options, grads = self._inverse_options(step.group), [item.grad for item in items]
        states, kind = [item.state for item in items], options.kind
        sources = [item.update.param for item in items]
        sources += [state.get(kind) for state in states]
        sources += [state.get("eigh_inverse") for state in states]
        inputs = (
            options,
            step.damping,
            [item.curvature_step for item in items],
            [grad.shape for grad in grads],
            [grad.dtype for grad in grads],
            [grad.device for grad in grads],
        )
        prepared, key = self._prepared(), ("inverses", id(step.group))
        found = prepared.get(key, sources, inputs)
        if found is not None:  # (the state of each step its own dict)
            return [(inverse, dict(kept)) for inverse, kept in found]
        solved, current = [], True
        for item in items:
            with item.naming_errors():
                inverse, kept, now = self._inverse(item, step, options)
            solved.append((inverse, kept))
            current = current and now
        if current:  # what the next step finds cached for the same inputs: these entries
            kept = [(kept.get(kind), kept.get("eigh_inverse")) for _, kept in solved]
            sources[len(items) :] = [entry for entries in zip(*kept) for entry in entries]
            prepared.put(key, sources, inputs, [(inverse, dict(kept)) for inverse, kept in solved])
        return solved

    def _inverse(self, item, step, options):
        """``(KroneckerInverse, cache entries to keep, whether the entry is current)`` of
        ``item``, from its cached entry (computed where due) under the group's
        :meth:`_inverse_options` ``options``."""
        grad, damping = item.grad, step.damping
        matrix = as_matrix(grad, item.curvature)
        derived = self._derived(item.curvature, step.group, damping, item.curvature_step, options)
        entry = cached(
            item.state.get(derived.name), derived.key, step.step, derived.interval, derived.compute
        )
        kept, current = {derived.name: entry}, entry["key"] == derived.key
        kind, value = derived.name, entry["value"]
        if kind == "trace_norm_eigh":  # the damped inverses of the decomposition, per λ
            key = (entry["step"], damping)
            solvers = cached(
                item.state.get("eigh_inverse"),
                key,
                step.step,
                1,
                lambda: eigh_solvers(value, damping),
            )
            kept["eigh_inverse"] = solvers
            kind, value = "inverse", solvers["value"]
        inverse = KroneckerInverse(kind, value, damping, tuple(matrix.shape[:-1]))
        return inverse, kept, current

    def _factored(self, inverse, item):
        """The factored direction of ``item`` (:meth:`_factored_direction`), or None."""
        if inverse.kind == "eigh":
            return None
        matrix = item.grad.reshape(*inverse.rows, -1)
        return self._factored_direction(inverse.solve, inverse.value, matrix, item.update.param)

    # ----------------------------------------------------------------- factored steps
    def collect(self):
        """As :meth:`CurvatureOptimizer.collect`; also watches the dense layers whose steps
        may be applied in factored form from the next forward on (``gradient_factors``)."""
        if self._capture is None:
            params = [p for g in self.param_groups for p in g["params"]]
            self._capture = FactorCapture(self, params)
        return super().collect()

    def step(self, closure=None):
        """As :meth:`CurvatureOptimizer.step`; the captured layer factors are dropped after."""
        try:
            return super().step(closure)
        finally:
            capture = self._capture
            if capture is not None:
                capture.clear()

    def _factored_direction(self, apply, solvers, matrix, param):
        """:func:`_factored` from the rows of ``param``'s gradient captured in the pass
        (``gradient_factors``), or None; their forming is skipped where their known count
        already says that it is not cheaper."""
        capture = self._capture
        if capture is None or len(solvers) != 2 or matrix.dim() != 2:  # (not per group)
            return None
        rows = capture.row_count(param)
        if rows is not None and not factored_cheaper(solvers, *matrix.shape, rows):
            return None
        return _factored(apply, solvers, matrix, self._gradient_factors(param))

    def _gradient_factors(self, param):
        """The rows of ``param``'s gradient captured in the pass, or None (``gradient_factors``)."""
        capture = self._capture
        return None if capture is None else capture.factors(param)

    def _curvature_scale(self, curvature):
        """``tr(B ⊗ A)/dim = (tr B/dim B)(tr A/dim A)``."""
        return math.prod(diagonal(f).mean() for f in curvature)

    def _quadratic(self, curvature, step):
        return kron_quadratic([dense(f) for f in curvature], as_matrix(step, curvature))


def _factored(apply, solvers, matrix, factors):
    """``(F_0⁻¹ leftᵀ)(F_1⁻¹ rightᵀ)ᵀ`` where that is cheaper and ``factors = (left, right)``
    give ``matrix = leftᵀ right`` (``gradient_factors``), else None."""
    if factors is None or len(solvers) != 2:
        return None
    left_rows, right_rows = factors
    rows = len(left_rows)
    if not factored_cheaper(solvers, *matrix.shape, rows) or not reproduces(matrix, factors):
        return None
    left = apply(solvers[:1], left_rows.mT.to(matrix.dtype))
    right = apply(solvers[1:], right_rows.mT.to(matrix.dtype))
    return left @ right.mT
