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
    """Exact diagonal of the generalized Gauss-Newton matrix: ``p.diag_ggn_exact``, ``p.shape``.

    ``G = Σ_n J_nᵀ H_n J_n`` (``J_n`` the Jacobian of the model output of sample ``n``
    w.r.t. the parameters, ``H_n`` the Hessian of the loss w.r.t. that output); the
    attribute is the entries of ``diag(G)`` belonging to ``p``, reshaped like ``p``.
    Scaling: ``G`` is that of the loss as computed, so with ``reduction="mean"`` it carries the
    loss's ``1/D`` (``D = N`` for an ``[N, C]`` cross-entropy input; see
    ``docs/conventions.md``) and is the average over samples; with ``"sum"`` it is the sum.
    Where a module mixes samples (BatchNorm in training mode) ``J`` is the Jacobian of the
    whole batch's outputs: ``diag(G) = Σ_{r,k} ĝ_rk²``, ``ĝ_rk`` the batch gradient of the
    square root's column ``k`` on row ``r`` alone (``R K`` propagated columns, ``N C`` for a
    classifier). Micro-batches add.

    Takes no arguments.

    Raises:
        MissingLossError: the backward pass did not come from a loss curvopt can read
            (an extended loss module or a supported functional loss).

    Example:
        >>> import torch, curvopt
        >>> from curvopt import extensions as ext
        >>> _ = torch.manual_seed(0)
        >>> model = curvopt.extend(torch.nn.Sequential(torch.nn.Linear(3, 2)))
        >>> lossfunc = curvopt.extend(torch.nn.CrossEntropyLoss())  # reduction="mean"
        >>> X, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
        >>> with curvopt.collect(ext.DiagGGNExact(), ext.BatchDiagGGNExact()):
        ...     lossfunc(model(X), y).backward()
        >>> w = model[0].weight
        >>> w.diag_ggn_exact.shape
        torch.Size([2, 3])
        >>> torch.allclose(w.diag_ggn_exact_batch.sum(0), w.diag_ggn_exact)
        True
    """

    quantity = Quantity("diag_ggn_exact", Kind.SUMMED, Combine.ADD, Producer.GGN_DIAGONAL)


class BatchDiagGGNExact(_Curvature):
    """Per-sample terms of the exact GGN diagonal: ``p.diag_ggn_exact_batch``, ``[N, *p.shape]``.

    Row ``n`` is ``diag(J_nᵀ H_n J_n)`` for ``p``, sample ``n``'s term of ``diag(G)``; the
    rows sum to :class:`DiagGGNExact`'s ``p.diag_ggn_exact``, and carry the same ``1/D`` under
    ``reduction="mean"``. Not defined where a module mixes samples (BatchNorm in training
    mode): raises there. Micro-batches concatenate.

    Takes no arguments.

    Example:
        >>> import torch, curvopt
        >>> from curvopt import extensions as ext
        >>> _ = torch.manual_seed(0)
        >>> model = curvopt.extend(torch.nn.Sequential(torch.nn.Linear(3, 2)))
        >>> lossfunc = curvopt.extend(torch.nn.CrossEntropyLoss())  # reduction="mean"
        >>> X, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
        >>> with curvopt.collect(ext.BatchDiagGGNExact()):
        ...     lossfunc(model(X), y).backward()
        >>> model[0].weight.diag_ggn_exact_batch.shape
        torch.Size([4, 2, 3])
    """

    quantity = Quantity(
        "diag_ggn_exact_batch", Kind.PER_SAMPLE, Combine.CONCATENATE, Producer.GGN_DIAGONAL
    )


class DiagGGNMC(_MonteCarlo):
    """Monte-Carlo estimate of the GGN diagonal: ``p.diag_ggn_mc``, shape ``p.shape``.

    ``H_n`` is replaced by ``(1/M) Σ_m s_nm s_nmᵀ`` with ``s_nm`` the gradient of the loss
    w.r.t. the output at a target drawn from the model's predictive distribution, so that
    ``E[s sᵀ] = H_n`` and ``E[diag_ggn_mc] = diag(G)`` (unbiased); one column per draw
    instead of the ``C`` columns of the exact square root. Scaling: ``G`` is that of the loss
    as computed, so with ``reduction="mean"`` it carries the loss's ``1/D`` (``D = N`` for an
    ``[N, C]`` cross-entropy input; see ``docs/conventions.md``) and is the average over
    samples; with ``"sum"`` it is the sum.

    Args:
        mc_samples: the number ``M ≥ 1`` of targets drawn per loss row from the model's
            predictive distribution (torch's global generator: ``torch.manual_seed`` makes
            the draw reproducible); the estimate averages over them. Default 1.

    Raises:
        ValueError: ``mc_samples`` is not a positive int.

    Example:
        >>> import torch, curvopt
        >>> from curvopt import extensions as ext
        >>> _ = torch.manual_seed(0)
        >>> model = curvopt.extend(torch.nn.Sequential(torch.nn.Linear(3, 2)))
        >>> lossfunc = curvopt.extend(torch.nn.CrossEntropyLoss())  # reduction="mean"
        >>> X, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
        >>> with curvopt.collect(ext.DiagGGNMC(mc_samples=2)):
        ...     lossfunc(model(X), y).backward()
        >>> model[0].weight.diag_ggn_mc.shape
        torch.Size([2, 3])
    """

    quantity = Quantity("diag_ggn_mc", Kind.SUMMED, Combine.ADD, Producer.GGN_DIAGONAL)


class BatchDiagGGNMC(_MonteCarlo):
    """Per-sample terms of the Monte-Carlo GGN diagonal: ``p.diag_ggn_mc_batch``, ``[N, *p.shape]``.

    Row ``n`` is sample ``n``'s term of :class:`DiagGGNMC`'s estimate; the rows sum to
    ``p.diag_ggn_mc`` of the same draw, and carry the same ``1/D`` under
    ``reduction="mean"``. Not defined where a module mixes samples (raises there).

    Args:
        mc_samples: the number ``M ≥ 1`` of targets drawn per loss row from the model's
            predictive distribution (torch's global generator: ``torch.manual_seed`` makes
            the draw reproducible); the estimate averages over them. Default 1.

    Raises:
        ValueError: ``mc_samples`` is not a positive int.

    Example:
        >>> import torch, curvopt
        >>> from curvopt import extensions as ext
        >>> _ = torch.manual_seed(0)
        >>> model = curvopt.extend(torch.nn.Sequential(torch.nn.Linear(3, 2)))
        >>> lossfunc = curvopt.extend(torch.nn.CrossEntropyLoss())  # reduction="mean"
        >>> X, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
        >>> with curvopt.collect(ext.BatchDiagGGNMC()):
        ...     lossfunc(model(X), y).backward()
        >>> model[0].weight.diag_ggn_mc_batch.shape
        torch.Size([4, 2, 3])
    """

    quantity = Quantity(
        "diag_ggn_mc_batch", Kind.PER_SAMPLE, Combine.CONCATENATE, Producer.GGN_DIAGONAL
    )


class DiagHessian(_Curvature):
    """Exact diagonal of the Hessian of the loss: ``p.diag_h``, shape ``p.shape``.

    ``diag(H)`` for ``p``: the GGN diagonal plus the terms of the second derivatives of
    curved nonlinearities (``tanh``, ``sigmoid``, ...), exact. Scaling: ``H`` is that of the
    loss as computed, so with ``reduction="mean"`` it carries the loss's ``1/D`` (``D = N``
    for an ``[N, C]`` cross-entropy input; see ``docs/conventions.md``) and is the average
    over samples; with ``"sum"`` it is the sum.
    Micro-batches add.

    Takes no arguments.

    Raises:
        UnsupportedModuleError: a module whose second derivatives curvopt does not know.

    Example:
        >>> import torch, curvopt
        >>> from curvopt import extensions as ext
        >>> _ = torch.manual_seed(0)
        >>> model = curvopt.extend(
        ...     torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
        ... )
        >>> lossfunc = curvopt.extend(torch.nn.CrossEntropyLoss())
        >>> X, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
        >>> with curvopt.collect(ext.DiagHessian(), ext.DiagGGNExact()):
        ...     lossfunc(model(X), y).backward()
        >>> model[0].weight.diag_h.shape
        torch.Size([4, 3])
        >>> torch.allclose(model[2].weight.diag_h, model[2].weight.diag_ggn_exact)  # last layer
        True
    """

    quantity = Quantity("diag_h", Kind.SUMMED, Combine.ADD, Producer.HESSIAN_DIAGONAL)


class BatchDiagHessian(_Curvature):
    """Per-sample terms of the Hessian diagonal: ``p.diag_h_batch``, ``[N, *p.shape]``.

    Row ``n`` is sample ``n``'s term of :class:`DiagHessian`'s ``diag(H)``; the rows sum to
    ``p.diag_h`` and carry the same ``1/D`` under ``reduction="mean"``. Not defined where a
    module mixes samples (raises there).

    Takes no arguments.

    Example:
        >>> import torch, curvopt
        >>> from curvopt import extensions as ext
        >>> _ = torch.manual_seed(0)
        >>> model = curvopt.extend(torch.nn.Sequential(torch.nn.Linear(3, 2)))
        >>> lossfunc = curvopt.extend(torch.nn.CrossEntropyLoss())  # reduction="mean"
        >>> X, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
        >>> with curvopt.collect(ext.BatchDiagHessian(), ext.DiagHessian()):
        ...     lossfunc(model(X), y).backward()
        >>> w = model[0].weight
        >>> w.diag_h_batch.shape
        torch.Size([4, 2, 3])
        >>> torch.allclose(w.diag_h_batch.sum(0), w.diag_h)
        True
    """

    quantity = Quantity(
        "diag_h_batch", Kind.PER_SAMPLE, Combine.CONCATENATE, Producer.HESSIAN_DIAGONAL
    )


class KFLR(_Curvature):
    """Kronecker factors of the GGN from the exact loss-Hessian square root: ``p.kflr``.

    ``p.kflr`` is ``[B, A]`` for a weight of shape ``[out, in, *kernel]`` and ``[B]`` for a
    bias, so that ``torch.kron(*p.kflr)`` approximates the block of ``G`` for ``vec(p)``
    (and is indexed like it). ``B = Σ_{n,k} V_nk V_nkᵀ`` (``out x out``, output side: the
    exact square root ``H_n = Σ_k s_nk s_nkᵀ`` propagated to the layer's output, ``V``), and
    ``A = mean_n x_n x_nᵀ`` (``in·prod(kernel)`` square, input side: the layer's inputs,
    unfolded for convolutions). ``B`` carries the loss's scale (``1/D`` under
    ``reduction="mean"``), ``A`` is a mean. With one sample and no weight sharing,
    ``kron(*p.kflr)`` is the GGN block exactly. (``nn.Embedding`` and Hugging Face's
    ``Conv1D`` list the input side first; the value's ``output_index`` says which.)
    Where a module mixes samples (BatchNorm in training mode) the columns are those of one row
    each (``R K`` of them), ``V`` their gradients at the layer's output for the whole batch,
    so ``B = Σ_n (∂f/∂z_n)ᵀ H (∂f/∂z_n)``, what :class:`KFAC`'s factors estimate there; a
    one-dimensional parameter's ``[B]`` is its GGN block exactly.
    Micro-batches combine: ``B`` adds, ``A`` averages weighted by batch size.

    Args:
        kfac_approx: ``"expand"`` (default) or ``"reduce"`` (Eschenhagen et al., 2023): for
            weights shared over positions (sequences, convolution locations), ``"expand"``
            treats positions like samples (``A`` averages over samples and positions, ``B``
            sums over them), ``"reduce"`` sums the output side and averages the inputs over
            positions first.
        samples: ``None`` (default: the whole batch) or ``K ≥ 1``: the factors of the first
            ``K`` samples of the batch alone, the output side ``B`` scaled to estimate the
            whole batch's (``N/K`` for ``reduction="sum"``, the sub-batch's own mean for
            ``"mean"``). Where a module mixes samples, the first ``K`` rows of the layer:
            ``B_K = (N/K) Σ_{m<K} (∂f/∂z_m)ᵀ H (∂f/∂z_m)``, every loss row's columns.

    Raises:
        ValueError: ``kfac_approx`` is not ``"expand"``/``"reduce"``, or ``samples`` is not
            ``None`` or a positive int.

    Example:
        >>> import torch, curvopt
        >>> from curvopt import extensions as ext
        >>> _ = torch.manual_seed(0)
        >>> model = curvopt.extend(torch.nn.Sequential(torch.nn.Linear(3, 2)))
        >>> lossfunc = curvopt.extend(torch.nn.CrossEntropyLoss())  # reduction="mean"
        >>> X, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
        >>> with curvopt.collect(ext.KFLR()):
        ...     lossfunc(model(X), y).backward()
        >>> [tuple(f.shape) for f in model[0].weight.kflr]  # [B, A]
        [(2, 2), (3, 3)]
        >>> [tuple(f.shape) for f in model[0].bias.kflr]  # [B]
        [(2, 2)]
        >>> torch.kron(*model[0].weight.kflr).shape  # the block of G for vec(weight)
        torch.Size([6, 6])
    """

    quantity = Quantity("kflr", Kind.FACTORS, Combine.FACTORS, Producer.KRONECKER)
    #: ``collect(skip_unsupported="diagonal")`` writes this instead where there are no factors
    fallback = declare(Quantity("kflr_diagonal", Kind.SUMMED, Combine.ADD, Producer.GGN_DIAGONAL))
    sub_batch = True

    def __init__(self, kfac_approx: str = "expand", samples=None):
        _check_approx(type(self).__name__, kfac_approx)
        super().__init__(kfac_approx=kfac_approx, samples=samples)


class KFAC(_MonteCarlo):
    """Kronecker factors of the GGN from sampled targets: ``p.kfac`` (Martens & Grosse, 2015).

    As :class:`KFLR` (``[B, A]`` for a weight, ``[B]`` for a bias, ``torch.kron(*p.kfac)``
    approximating the block of ``G`` for ``vec(p)``), with the output side built from
    ``mc_samples`` columns of gradients at targets drawn from the model's predictive
    distribution instead of the exact loss-Hessian square root: ``E[B]`` is :class:`KFLR`'s
    ``B``. Same scaling (``1/D`` on ``B`` under ``reduction="mean"``). With ``samples=K`` the
    draw is still made for every row, so that the first ``K`` samples get the targets a
    whole-batch ``KFAC`` of the same seed draws.

    Args:
        mc_samples: the number ``M ≥ 1`` of targets drawn per loss row from the model's
            predictive distribution (torch's global generator: ``torch.manual_seed`` makes
            the draw reproducible); the estimate averages over them. Default 1.
        kfac_approx: ``"expand"`` (default) or ``"reduce"`` (Eschenhagen et al., 2023): for
            weights shared over positions (sequences, convolution locations), ``"expand"``
            treats positions like samples (``A`` averages over samples and positions, ``B``
            sums over them), ``"reduce"`` sums the output side and averages the inputs over
            positions first.
        samples: ``None`` (default: the whole batch) or ``K ≥ 1``: the factors of the first
            ``K`` samples of the batch alone, the output side ``B`` scaled to estimate the
            whole batch's (``N/K`` for ``reduction="sum"``, the sub-batch's own mean for
            ``"mean"``).

    Raises:
        ValueError: ``mc_samples`` is not a positive int, ``kfac_approx`` is not
            ``"expand"``/``"reduce"``, or ``samples`` is not ``None`` or a positive int.

    Example:
        >>> import torch, curvopt
        >>> from curvopt import extensions as ext
        >>> _ = torch.manual_seed(0)
        >>> model = curvopt.extend(torch.nn.Sequential(torch.nn.Linear(3, 2)))
        >>> lossfunc = curvopt.extend(torch.nn.CrossEntropyLoss())  # reduction="mean"
        >>> X, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
        >>> with curvopt.collect(ext.KFAC(mc_samples=1)):
        ...     lossfunc(model(X), y).backward()
        >>> B, A = model[0].weight.kfac
        >>> B.shape, A.shape
        (torch.Size([2, 2]), torch.Size([3, 3]))
    """

    quantity = Quantity("kfac", Kind.FACTORS, Combine.FACTORS, Producer.KRONECKER)
    #: ``collect(skip_unsupported="diagonal")`` writes this instead where there are no factors
    fallback = declare(Quantity("kfac_diagonal", Kind.SUMMED, Combine.ADD, Producer.GGN_DIAGONAL))
    sub_batch = True

    def __init__(self, mc_samples: int = 1, kfac_approx: str = "expand", samples=None):
        _check_approx(type(self).__name__, kfac_approx)
        super().__init__(mc_samples=mc_samples, kfac_approx=kfac_approx, samples=samples)


class KFACEmpirical(_Curvature):
    """Kronecker factors of the empirical Fisher: ``p.kfac_empirical``.

    As :class:`KFLR`, with one column, the gradient of the loss w.r.t. its input at the
    observed targets times ``√c``, in place of the loss-Hessian square root:
    ``torch.kron(*p.kfac_empirical)`` approximates the block of the empirical Fisher
    ``EF = c Σ_n vec(g_n) vec(g_n)ᵀ`` (``c`` the loss's divisor: 1 for ``"sum"``, ``N``, the
    kept rows of a flattened sequence, or ``N·K`` for ``MSELoss`` for ``"mean"``), which is on
    the GGN's scale. With one sample and no weight sharing it is that block exactly.

    Args:
        kfac_approx: ``"expand"`` (default) or ``"reduce"`` (Eschenhagen et al., 2023): for
            weights shared over positions (sequences, convolution locations), ``"expand"``
            treats positions like samples (``A`` averages over samples and positions, ``B``
            sums over them), ``"reduce"`` sums the output side and averages the inputs over
            positions first.
        samples: ``None`` (default: the whole batch) or ``K ≥ 1``: the factors of the first
            ``K`` samples of the batch alone, the output side ``B`` scaled to estimate the
            whole batch's (``N/K`` for ``reduction="sum"``, the sub-batch's own mean for
            ``"mean"``).

    Raises:
        ValueError: ``kfac_approx`` is not ``"expand"``/``"reduce"``, or ``samples`` is not
            ``None`` or a positive int.

    Example:
        >>> import torch, curvopt
        >>> from curvopt import extensions as ext
        >>> _ = torch.manual_seed(0)
        >>> model = curvopt.extend(torch.nn.Sequential(torch.nn.Linear(3, 2)))
        >>> lossfunc = curvopt.extend(torch.nn.CrossEntropyLoss())  # reduction="mean"
        >>> X, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
        >>> with curvopt.collect(ext.KFACEmpirical()):
        ...     lossfunc(model(X), y).backward()
        >>> [tuple(f.shape) for f in model[0].weight.kfac_empirical]
        [(2, 2), (3, 3)]
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
    """Kronecker factors with recursively propagated curvature: ``p.kfra`` (Botev et al., 2017).

    As :class:`KFLR` (``[B, A]`` for a weight, ``[B]`` for a bias), with the output side
    ``B`` the batch-averaged GGN propagated backwards layer by layer,
    ``B_l = (W_{l+1}ᵀ B_{l+1} W_{l+1}) ⊙ mean_n d_n d_nᵀ`` (``d_n`` the activation
    derivative), instead of per-sample columns. Same scaling (``1/D`` under
    ``reduction="mean"``). Feed-forward chains of ``Linear`` layers and element-wise
    activations only. Several backward passes in one ``collect`` do not combine: the
    second raises ``AccumulationError``.

    Takes no arguments.

    Raises:
        UnsupportedModuleError: a module outside such a chain.

    Example:
        >>> import torch, curvopt
        >>> from curvopt import extensions as ext
        >>> _ = torch.manual_seed(0)
        >>> model = curvopt.extend(
        ...     torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        ... )
        >>> lossfunc = curvopt.extend(torch.nn.CrossEntropyLoss())
        >>> X, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
        >>> with curvopt.collect(ext.KFRA()):
        ...     lossfunc(model(X), y).backward()
        >>> [tuple(f.shape) for f in model[0].weight.kfra]
        [(4, 4), (3, 3)]
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
    """Eigenvalue-corrected Kronecker curvature: ``p.ekfac = [S, Q_0, Q_1]`` (George et al., 2018).

    ``Q_0, Q_1`` are the eigenvectors (``psd_eigh``) of this pass's Kronecker factors, in
    ``p``'s dim order: ``[S, Q_B, Q_A]`` for ``Linear``/conv weights, ``[S, Q_A, Q_B]`` for
    ``Embedding``, ``[S, Q_B]`` for one-dimensional parameters. ``S`` (``[dim Q_0, dim Q_1]``,
    ``[dim Q_0, 1]`` for one-dimensional ``p``) is the second moment of the per-sample
    gradients in that eigenbasis::

        S = c · Σ_n (Q_0ᵀ G_n Q_1)²        (element-wise square)

    with ``G_n`` the per-sample gradient ``g_n`` (of the loss as computed) reshaped to
    ``[p.shape[0], -1]``, and ``c = D`` the divisor of a loss with ``reduction="mean"`` (``N``
    for one term per sample, the counted rows of a flattened sequence loss, ``N·K`` for
    ``MSELoss`` on ``K`` outputs), ``c = 1`` for ``"sum"``, divided by the factor the loss
    enters the backward pass with (so ``S`` is linear in it, as the GGN is). Then
    ``vec S = diag(Qᵀ EF Q)`` for the empirical Fisher ``EF = c Σ_n vec(g_n) vec(g_n)ᵀ`` on the
    GGN's scale, and ``E[S] = diag(Qᵀ G Q)`` under targets drawn from the model.

    A dense layer without weight sharing never forms a per-sample gradient
    (``S = c (b̃²)ᵀ (ã²)`` from the rotated inputs ``ã = a Q_1`` and output gradients
    ``b̃ = b Q_0``); with shared positions (sequences, conv locations) the rotated per-sample
    gradients are formed in chunks of samples. Micro-batches combine (``S`` adds) only where
    the bases were supplied; fresh bases of two passes differ and raise.

    A module that mixes samples (BatchNorm in training mode) leaves no per-sample gradients:
    there ``S = Σ_k (Q_0ᵀ Ĝ_k Q_1)²`` with ``Ĝ_k`` the batch gradient of the ``k``-th of the
    ``mc_samples`` sampled columns, so that ``E[S] = diag(Qᵀ G Q)`` for fixed bases (the GGN's
    diagonal in the basis, not the empirical Fisher's); with ``factors="kflr"`` the columns
    are the exact ones of one row each (``R K`` of them, :class:`KFLR`) and ``S = diag(Qᵀ G Q)``.
    ``collect(skip_unsupported="diagonal")`` writes ``p.ekfac_diagonal`` for a parameter
    without factors: the GGN diagonal of the same columns (Monte-Carlo, or exact for
    ``"kflr"``).

    Args:
        mc_samples: sampled columns of the factors for ``factors="kfac"`` (default 1).
        factors: ``"kfac"`` (default: Monte-Carlo factors, :class:`KFAC`) or ``"kflr"``
            (exact, :class:`KFLR`): the factors whose eigenvectors are the bases.
        kfac_approx: ``"expand"`` (default) or ``"reduce"``, as for :class:`KFAC`.
        bases: ``None`` (default: fresh bases), a dict ``{param: [Q_0, Q_1]}`` or a callable
            ``param -> [Q_0, Q_1]`` (``None`` for fresh bases): for those parameters no
            factors are computed, only ``S`` in the given orthogonal bases (``[]`` is the
            identity, ``S`` then ``[1, numel]``), and ``p.ekfac`` holds the supplied tensors.
        reduction: ``None`` (default) or the ``"mean"``/``"sum"`` the caller expects; a loss
            with another reduction raises.
        samples: ``None`` (default) or ``K``: fresh bases from the factors of the first ``K``
            samples (as :class:`KFAC`'s ``samples``); ``S`` is still that of the whole batch.

    Raises:
        ValueError: an unknown ``factors``, ``reduction`` or ``kfac_approx``, or an invalid
            ``mc_samples``/``samples``.
        TypeError: ``bases`` is neither ``None``, a dict of tensor lists nor a callable.

    Example:
        >>> import torch, curvopt
        >>> from curvopt import extensions as ext
        >>> _ = torch.manual_seed(0)
        >>> model = curvopt.extend(torch.nn.Sequential(torch.nn.Linear(3, 2)))
        >>> lossfunc = curvopt.extend(torch.nn.CrossEntropyLoss())
        >>> X, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
        >>> with curvopt.collect(ext.EKFAC()):
        ...     lossfunc(model(X), y).backward()
        >>> [tuple(t.shape) for t in model[0].weight.ekfac]  # [S, Q_B, Q_A]
        [(2, 3), (2, 2), (3, 3)]
        >>> [tuple(t.shape) for t in model[0].bias.ekfac]  # [S, Q_B]
        [(2, 1), (2, 2)]
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
