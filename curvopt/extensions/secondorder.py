"""Second-order quantities: curvature of the loss as the loss module computes it.

``G = sum_n J_n^T H_n J_n`` is the generalized Gauss-Newton matrix (``J_n`` the Jacobian of the
model output of sample ``n`` w.r.t. the parameters, ``H_n`` the Hessian of the loss w.r.t. that
output, including the reduction's ``1/N``). Every quantity is computed from a square-root
factor ``H_n = sum_k s_nk s_nk^T`` (exact: ``K`` columns from the loss; Monte-Carlo: ``mc_samples``
columns from targets sampled from the model's predictive distribution), propagated backwards.
"""

import torch

from curvopt.extensions.base import Extension
from curvopt.extensions.quantity import Combine, Kind, Producer, Quantity, declare


class _Curvature(Extension):
    source = "exact"
    #: whether ``samples=K`` (curvature from the first ``K`` samples of the batch) exists: the
    #: Kronecker factors only (``KFAC``, ``KFLR``, ``KFACEmpirical``, ``EKFAC``'s bases)
    sub_batch = False

    def __init__(self, samples=None, **options):
        name = type(self).__name__
        if samples is not None and not self.sub_batch:
            raise ValueError(
                f"{name}: samples= (curvature from a sub-batch) exists for the Kronecker factors "
                "only (KFAC, KFLR, KFACEmpirical, EKFAC's bases); drop it for this quantity "
                "(optim: curvature_samples=None, or curvature='kfac'/'kflr')"
            )
        if samples is not None and (
            not isinstance(samples, int) or isinstance(samples, bool) or samples < 1
        ):
            raise ValueError(
                f"{name}: samples must be a positive int (the factors from the first K samples "
                f"of each batch) or None (the whole batch), got {samples!r} (optim: "
                "curvature_samples)"
            )
        if samples is not None:  # kept out of the options otherwise: the same key as before
            options["samples"] = samples
        super().__init__(**options)


class _MonteCarlo(_Curvature):
    source = "mc"

    def __init__(self, mc_samples: int = 1, **options):
        if not isinstance(mc_samples, int) or isinstance(mc_samples, bool) or mc_samples < 1:
            raise ValueError(
                f"{type(self).__name__}: mc_samples must be a positive int, got {mc_samples!r}"
            )
        super().__init__(mc_samples=mc_samples, **options)


def _check_approx(name, kfac_approx):
    if kfac_approx not in ("expand", "reduce"):
        raise ValueError(f"{name}: kfac_approx must be 'expand' or 'reduce', got {kfac_approx!r}")


class DiagGGNExact(_Curvature):
    """``p.diag_ggn_exact``: ``diag(G)`` for ``p`` (shape of ``p``)."""

    quantity = Quantity("diag_ggn_exact", Kind.SUMMED, Combine.ADD, Producer.GGN_DIAGONAL)


class BatchDiagGGNExact(_Curvature):
    """``p.diag_ggn_exact_batch``: per-sample terms ``diag(J_n^T H_n J_n)``, ``[N, *p.shape]``."""

    quantity = Quantity(
        "diag_ggn_exact_batch", Kind.PER_SAMPLE, Combine.CONCATENATE, Producer.GGN_DIAGONAL
    )


class DiagGGNMC(_MonteCarlo):
    """``p.diag_ggn_mc``: unbiased Monte-Carlo estimate of ``diag(G)`` (shape of ``p``)."""

    quantity = Quantity("diag_ggn_mc", Kind.SUMMED, Combine.ADD, Producer.GGN_DIAGONAL)


class BatchDiagGGNMC(_MonteCarlo):
    """``p.diag_ggn_mc_batch``: per-sample terms of ``diag_ggn_mc``, ``[N, *p.shape]``."""

    quantity = Quantity(
        "diag_ggn_mc_batch", Kind.PER_SAMPLE, Combine.CONCATENATE, Producer.GGN_DIAGONAL
    )


class DiagHessian(_Curvature):
    """``p.diag_h``: ``diag(H)``, the GGN diagonal plus the curvature of nonlinearities."""

    quantity = Quantity("diag_h", Kind.SUMMED, Combine.ADD, Producer.HESSIAN_DIAGONAL)


class BatchDiagHessian(_Curvature):
    """``p.diag_h_batch``: per-sample terms of ``diag_h``, ``[N, *p.shape]``."""

    quantity = Quantity(
        "diag_h_batch", Kind.PER_SAMPLE, Combine.CONCATENATE, Producer.HESSIAN_DIAGONAL
    )


class KFLR(_Curvature):
    """``p.kflr``: Kronecker factors ``[B, A]`` (weights) or ``[B]`` (biases) of the GGN block.

    ``B = sum_{n,k} V_nk V_nk^T`` (output side, exact loss-Hessian square root ``V`` propagated
    to the layer output), ``A = mean_n x_n x_n^T`` (input side). For inputs with extra positions
    (sequences, conv locations) ``kfac_approx="expand"`` treats positions like samples
    (``A`` averages over samples and positions, ``B`` sums over them) and ``"reduce"`` sums
    ``V`` and averages ``x`` over positions first (Eschenhagen et al., 2023).

    ``samples=K`` (``None``: the whole batch): the factors of the first ``K`` samples of the
    batch alone, with the output side scaled to estimate the whole batch's (``N/K`` for
    ``reduction="sum"``, the sub-batch's own mean for ``"mean"``; see docs/conventions.md).
    """

    quantity = Quantity("kflr", Kind.FACTORS, Combine.FACTORS, Producer.KRONECKER)
    #: ``collect(skip_unsupported="diagonal")`` writes this instead where there are no factors
    fallback = declare(Quantity("kflr_diagonal", Kind.SUMMED, Combine.ADD, Producer.GGN_DIAGONAL))
    sub_batch = True

    def __init__(self, kfac_approx: str = "expand", samples=None):
        _check_approx(type(self).__name__, kfac_approx)
        super().__init__(kfac_approx=kfac_approx, samples=samples)


class KFAC(_MonteCarlo):
    """``p.kfac``: as :class:`KFLR` with ``mc_samples`` sampled columns instead of exact ones
    (``samples=K``: as for :class:`KFLR`; the draw is still made for every row, so that the
    first ``K`` samples get the targets a whole-batch ``KFAC`` of the same seed draws)."""

    quantity = Quantity("kfac", Kind.FACTORS, Combine.FACTORS, Producer.KRONECKER)
    #: ``collect(skip_unsupported="diagonal")`` writes this instead where there are no factors
    fallback = declare(Quantity("kfac_diagonal", Kind.SUMMED, Combine.ADD, Producer.GGN_DIAGONAL))
    sub_batch = True

    def __init__(self, mc_samples: int = 1, kfac_approx: str = "expand", samples=None):
        _check_approx(type(self).__name__, kfac_approx)
        super().__init__(mc_samples=mc_samples, kfac_approx=kfac_approx, samples=samples)


class KFACEmpirical(_Curvature):
    """``p.kfac_empirical``: as :class:`KFLR` with one column, the gradient of the loss w.r.t.
    its input at the observed targets, in place of the loss-Hessian square root: Kronecker
    factors of the empirical Fisher ``EF = c sum_n vec(g_n) vec(g_n)^T`` (``c`` the loss's
    divisor: 1 for "sum", ``N`` or the kept rows for "mean"; on the GGN's scale). With one
    sample and no weight sharing, ``kron(*p.kfac_empirical)`` is the EF block exactly.
    ``samples=K``: as for :class:`KFLR`.
    """

    source = "empirical"
    quantity = Quantity("kfac_empirical", Kind.FACTORS, Combine.FACTORS, Producer.KRONECKER)
    #: ``collect(skip_unsupported="diagonal")`` writes this instead where there are no factors
    fallback = declare(
        Quantity("kfac_empirical_diagonal", Kind.SUMMED, Combine.ADD, Producer.GGN_DIAGONAL)
    )
    sub_batch = True

    def __init__(self, kfac_approx: str = "expand", samples=None):
        _check_approx(type(self).__name__, kfac_approx)
        super().__init__(kfac_approx=kfac_approx, samples=samples)


class KFRA(_Curvature):
    """``p.kfra``: Kronecker factors with the batch-averaged GGN propagated recursively
    (Botev et al., 2017): ``B_l = (W_{l+1}^T B_{l+1} W_{l+1}) * mean_n d_n d_n^T`` with
    ``d_n`` the activation derivative. Feed-forward chains of ``Linear`` layers and elementwise
    activations only.
    """

    quantity = Quantity("kfra", Kind.FACTORS, Combine.RAISES, Producer.KFRA)


def _described(p):
    """A dict key of ``bases`` for a message: the parameter's shape."""
    shape = tuple(p.shape) if isinstance(p, torch.Tensor) else None
    return f"parameter of shape {shape}" if shape is not None else repr(p)


def _supplied(bases):
    """``bases`` (None, a dict ``{param: [Q_0, ...]}`` or a callable ``param -> [Q_0, ...] or
    None``) as a callable; the dict is looked up by identity (tensors hash by id)."""
    if bases is None or callable(bases):
        return bases
    if isinstance(bases, dict):
        for p, q in bases.items():
            if not isinstance(q, (list, tuple)) or not all(isinstance(m, torch.Tensor) for m in q):
                raise TypeError(
                    f"EKFAC: bases[{_described(p)}] must be a list of tensors [Q_0, Q_1] (or a "
                    f"prefix of it, [] for the identity), got {type(q).__name__}; leave a "
                    "parameter out of the dict (or return None from a callable) for fresh bases"
                )
        by_id = {id(p): list(q) for p, q in bases.items()}
        return lambda p: by_id.get(id(p))
    raise TypeError(
        "EKFAC: bases must be None, a dict {parameter: [Q_0, Q_1]} or a callable "
        f"parameter -> [Q_0, Q_1] (or None: fresh bases), got {type(bases).__name__}"
    )


class EKFAC(_MonteCarlo):
    """``p.ekfac = [S, Q_0, Q_1]`` (``[S, Q_0]`` for one-dimensional parameters): the second
    moment of the per-sample gradients in the eigenbasis of the Kronecker factors (George et
    al., 2018), ``S = c · Σ_n (Q_0ᵀ G_n Q_1)²`` (element-wise square, ``[dim Q_0, dim Q_1]``).

    ``G_n`` is ``g_n`` (the gradient of the loss as computed, restricted to sample ``n``)
    reshaped to ``[p.shape[0], -1]`` (``[p.shape[0], 1]`` for one-dimensional ``p``); ``c = D``,
    the divisor of a loss with ``reduction="mean"`` (``N`` for one term per sample, the counted
    rows of a flattened sequence loss, ``N K`` for ``MSELoss`` on ``K`` outputs), 1 for
    ``"sum"``, read from the loss, divided by the factor ``w`` the loss enters the backward
    pass with (so that ``S`` is linear in ``w``, as the GGN is), so that ``vec S = diag(Qᵀ EF
    Q)`` for the empirical Fisher on the GGN's scale (``E[S] = diag(Qᵀ G Q)`` under targets
    drawn from the model). ``Q_0, Q_1`` are
    the eigenvectors (``psd_eigh``) of this pass's Kronecker factors, in ``p``'s dim order
    (``[Q_B, Q_A]`` for ``Linear``/conv weights, ``[Q_A, Q_B]`` for ``Embedding``):
    ``factors="kfac"`` (``mc_samples`` sampled columns) or ``"kflr"`` (exact), with
    ``kfac_approx`` as for :class:`KFAC`.

    ``bases``: a dict ``{param: [Q_0, Q_1]}`` or a callable ``param -> [Q_0, Q_1]`` (``None``
    for fresh bases) supplies the bases of those parameters: no factors are computed for them,
    only ``S`` in the given basis (any orthogonal matrices of the right sizes; ``[]`` is the
    identity, ``S`` then ``[1, numel]``), and ``p.ekfac`` holds the supplied tensors.
    ``reduction`` (``"mean"``/``"sum"``, optional): the one the caller expects; a loss with
    another raises.

    Costs: a dense layer without weight sharing never forms a per-sample gradient,
    ``S = c (b̃²)ᵀ (ã²)`` with ``ã = a Q_1``, ``b̃ = b Q_0`` the rotated inputs and output
    gradients; with ``P`` shared positions (sequences, conv locations) the per-sample rotated
    gradients ``b̃_nᵀ ã_n`` are formed in chunks of samples (``N P (O² + I² + O I)`` flops);
    other parameters rotate their per-sample gradients. Micro-batches combine (``S`` adds,
    each pass with its own ``c``, as ``diag_ggn`` and ``kfac``'s ``B`` add) only where the
    bases were supplied; fresh bases of two passes differ and raise.

    ``samples=K``: the fresh bases from the factors of the first ``K`` samples (as
    :class:`KFAC`'s ``samples``); ``S`` is still that of the whole batch.

    A module that mixes samples (BatchNorm in training mode) leaves no per-sample gradients:
    there ``S = Σ_k (Q_0ᵀ Ĝ_k Q_1)²`` with ``Ĝ_k`` the batch gradient of the ``k``-th of the
    ``mc_samples`` sampled columns (the columns the bases come from, supplied bases or fresh),
    unscaled, so that ``E[S] = diag(Qᵀ G Q)`` for fixed bases: the GGN's diagonal in the basis,
    not the empirical Fisher's (``engine.reducer``); ``factors="kflr"`` raises there.
    ``collect(skip_unsupported="diagonal")`` writes ``p.ekfac_diagonal`` for a parameter without
    factors: the GGN diagonal of the same columns (Monte-Carlo, or exact for ``"kflr"``).
    """

    quantity = Quantity("ekfac", Kind.EIGEN_CORRECTED, Combine.SAME_BASIS, Producer.EIGEN_CORRECTED)
    #: ``collect(skip_unsupported="diagonal")`` writes this instead where there are no factors:
    #: the GGN diagonal of the columns its bases come from (as ``kfac_diagonal``/``kflr_diagonal``)
    fallback = declare(Quantity("ekfac_diagonal", Kind.SUMMED, Combine.ADD, Producer.GGN_DIAGONAL))
    sub_batch = True

    def __init__(
        self,
        mc_samples: int = 1,
        factors: str = "kfac",
        kfac_approx: str = "expand",
        bases=None,
        reduction=None,
        samples=None,
    ):
        if factors not in ("kfac", "kflr"):
            raise ValueError(f"EKFAC: factors must be 'kfac' or 'kflr', got {factors!r}")
        if reduction not in (None, "mean", "sum"):
            raise ValueError(f"EKFAC: reduction must be None, 'mean' or 'sum', got {reduction!r}")
        _check_approx(type(self).__name__, kfac_approx)
        super().__init__(
            mc_samples=mc_samples,
            factors=factors,
            kfac_approx=kfac_approx,
            bases=_supplied(bases),
            reduction=reduction,
            samples=samples,
        )
        self.source = "mc" if factors == "kfac" else "exact"

    def supplied(self, p):
        """The bases supplied for ``p`` (a list), or ``None``: fresh bases."""
        lookup = self.options["bases"]
        return None if lookup is None else lookup(p)


SECOND_ORDER = (
    DiagGGNExact,
    BatchDiagGGNExact,
    DiagGGNMC,
    BatchDiagGGNMC,
    DiagHessian,
    BatchDiagHessian,
    KFLR,
    KFAC,
    KFACEmpirical,
    KFRA,
    EKFAC,
)
