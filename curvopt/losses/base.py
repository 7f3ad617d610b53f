"""Registry and base classes of loss rules.

A rule factorises, for one loss type, the Hessian of the loss value w.r.t. the loss input
``output`` of shape ``[N, *F]`` (sample ``n`` is ``output[n]``, ``P = prod(F)``). The loss is a
sum over samples, so that Hessian is block-diagonal with ``P x P`` blocks ``H_n``. A factor
``S`` of shape ``[K, N, *F]``, with ``s_k = S[k, n].flatten()``, satisfies

    H_n = sum_k s_k s_k^T          exact factor (``sqrt_hessian``)
    H_n = E[sum_m s_m s_m^T]       Monte-Carlo factor (``sqrt_hessian_mc``), targets sampled
                                   from the predictive distribution the loss implies.
"""

import math
from abc import ABC, abstractmethod

import torch

from curvopt.errors import UnsupportedLossError, reduction_none_error

_RULES = {}


def register_loss_rule(loss_type):
    """Class decorator: register an instance of the decorated ``LossRule`` for ``loss_type``."""

    def register(rule_cls):
        rule_cls.loss_type = loss_type
        _RULES[loss_type] = rule_cls()
        return rule_cls

    return register


def has_loss_rule(loss_module) -> bool:
    """Whether :func:`loss_rule_for` finds a rule for ``loss_module``'s class (its options
    are not checked)."""
    return _rule_of(type(loss_module)) is not None


def _rule_of(loss_cls):
    """The rule of ``loss_cls``: its own, else that of its nearest registered base class
    unless it overrides that class's ``forward``; None for neither."""
    rule = _RULES.get(loss_cls)
    if rule is not None:
        return rule
    base = _registered_base(loss_cls)
    return None if base is None or loss_cls.forward is not base.forward else _RULES[base]


def _registered_base(loss_cls):
    """The nearest base class of ``loss_cls`` with a registered rule, or None."""
    return next((c for c in loss_cls.__mro__[1:] if c in _RULES), None)


def loss_rule_for(loss_module):
    """The rule of ``loss_module``; raises ``UnsupportedLossError`` for unknown losses/options.

    A subclass of a registered loss uses that loss's rule unless it overrides ``forward``.
    """
    loss_cls = type(loss_module)
    rule = _rule_of(loss_cls)
    if rule is None:
        base = _registered_base(loss_cls)
        supported = ", ".join(sorted(c.__name__ for c in _RULES))
        raise UnsupportedLossError(
            f"curvopt cannot compute curvature for the loss {loss_cls.__name__}"
            + (f" (it overrides {base.__name__}.forward)" if base is not None else "")
            + f". Use one of {supported}, or add a curvopt.losses.LossRule subclass decorated "
            f"with @curvopt.losses.register_loss_rule({loss_cls.__name__}); see "
            "docs/support.md#losses."
        )
    rule.check_options(loss_module)
    return rule


def reduction_scale(loss_module, count):
    """Factor the reduction puts on the summed loss: 1 for "sum", ``1 / count`` for "mean"."""
    return 1.0 if loss_module.reduction == "sum" else 1.0 / count


def _all_finite(x: torch.Tensor) -> bool:
    """Whether every element of ``x`` is finite: ``max |x|`` is, as the maximum propagates nan
    (two operators and one read, where ``isfinite(x).all()`` runs five)."""
    return math.isfinite(x.abs().amax().item())


def _column_indices(columns, num_columns, device):
    """Column indices ``[k]`` (long) selected by ``columns`` (None, range or slice)."""
    if columns is None:
        columns = range(num_columns)
    elif isinstance(columns, slice):
        columns = range(*columns.indices(num_columns))
    elif not isinstance(columns, range):
        raise TypeError(f"columns must be None, a range or a slice, got {type(columns).__name__}")
    if len(columns) and (min(columns) < 0 or max(columns) >= num_columns):
        raise ValueError(f"columns {columns} out of bounds for a factor with {num_columns} columns")
    return torch.arange(columns.start, columns.stop, columns.step, device=device)


def _detached(output: torch.Tensor) -> torch.Tensor:
    """``output`` out of the autograd graph (itself where it is: no operator)."""
    return output.detach() if output.requires_grad else output


class LossRule(ABC):
    """Square-root factorisation of one loss type's Hessian w.r.t. its input (see module doc)."""

    loss_type = None  # set by ``register_loss_rule``
    #: whether ``H_n`` is diagonal (every entry of the input an independent unit)
    elementwise = False

    def check_options(self, loss_module):
        """Reject module options the math cannot honour (independent of the data)."""
        name = type(loss_module).__name__
        if loss_module.reduction == "none":
            raise reduction_none_error(name)
        if loss_module.reduction not in ("mean", "sum"):
            raise UnsupportedLossError(
                f"{name} has unknown reduction={loss_module.reduction!r}. Use 'mean' or 'sum'."
            )

    def check(self, loss_module, output, target) -> float:
        """Validate options, ``output`` (float, ``[N, ...]``, finite) and ``target``; returns
        their :meth:`divisor` (which a rule's target check may prove on the way)."""
        self.check_options(loss_module)
        name = type(loss_module).__name__
        if not isinstance(output, torch.Tensor):
            raise TypeError(
                f"{name}: the loss input must be a tensor, got {type(output).__name__}."
            )
        if not output.is_floating_point():
            raise ValueError(
                f"{name}: the loss input must be a floating-point tensor, got {output.dtype}."
            )
        if output.dim() == 0 or output.numel() == 0:
            raise ValueError(
                f"{name}: the loss input must have a batch dimension and at least one "
                f"element, got shape {tuple(output.shape)}."
            )
        if not _all_finite(output):
            raise ValueError(
                f"{name}: the loss input contains inf or nan; its Hessian is undefined."
            )
        if not isinstance(target, torch.Tensor):
            raise TypeError(f"{name}: target must be a tensor, got {type(target).__name__}.")
        divisor = self._check_target(loss_module, output, target)
        return self.divisor(loss_module, output, target) if divisor is None else divisor

    @abstractmethod
    def _check_target(self, loss_module, output, target):
        """Raise ``ValueError``/``UnsupportedLossError`` for bad targets (output already valid);
        return the :meth:`divisor` where the check found it, else None."""

    def divisor(self, loss_module, output, target) -> float:
        """``D`` with ``loss = (1/D) Σ_r ℓ_r`` over the loss's terms ``r``: 1 for "sum", the
        number of terms :meth:`_mean_count` for "mean" (the scale of ``EKFAC``'s ``S``)."""
        if loss_module.reduction == "sum":
            return 1.0
        return float(self._mean_count(loss_module, output, target))

    def _mean_count(self, loss_module, output, target):
        """The normaliser of reduction "mean": every element of ``output`` (one term each)."""
        return output.numel()

    def reduction_scale(self, loss_module, output, target, divisor=None) -> float:
        """``s = N / D``, ``N = output.shape[0]`` the loss's samples and ``D`` its
        :meth:`divisor`: the factor by which the reduction scales one sample's curvature
        (``Σ_n J_nᵀ H_n J_n / D``): 1 for a mean over samples (one term each, as a
        cross-entropy over ``[N, C]`` logits or ``[N·T, V]`` flattened tokens), ``N`` for
        "sum", ``1/P`` for a mean over the ``P`` outputs of each sample (a per-pixel mean);
        0 when the mean counts no term. ``divisor``: :meth:`divisor` of these arguments, where
        the caller holds it (a pass computes it once)."""
        if divisor is None:
            divisor = self.divisor(loss_module, output, target)
        return output.shape[0] / divisor if divisor else 0.0

    @abstractmethod
    def num_columns(self, loss_module, output):
        """Number ``K`` of columns of the exact factor."""

    def sqrt_hessian(self, loss_module, output, target, columns=None, check=True, divisor=None):
        """Exact factor ``[k, *output.shape]``: rows ``columns`` (default all ``K``) of ``S``
        (``check=False``: the caller has run :meth:`check` on these arguments; ``divisor``:
        their :meth:`divisor`, where the caller holds it)."""
        if check:
            checked = self.check(loss_module, output, target)
            divisor = checked if divisor is None else divisor
        output = _detached(output)
        ks = _column_indices(columns, self.num_columns(loss_module, output), output.device)
        return self._sqrt_hessian(loss_module, output, target, ks, divisor)

    def sqrt_hessian_mc(self, loss_module, output, target, mc_samples, check=True, divisor=None):
        """Monte-Carlo factor ``[mc_samples, *output.shape]``, unbiased for ``H_n`` (``check``
        and ``divisor`` as in :meth:`sqrt_hessian`)."""
        if isinstance(mc_samples, bool) or not isinstance(mc_samples, int) or mc_samples < 1:
            raise ValueError(f"mc_samples must be a positive int, got {mc_samples!r}")
        if check:
            checked = self.check(loss_module, output, target)
            divisor = checked if divisor is None else divisor
        output = _detached(output)
        return self._sqrt_hessian_mc(loss_module, output, target, mc_samples, divisor)

    @abstractmethod
    def _sqrt_hessian(self, loss_module, output, target, ks, divisor):
        """Rows ``ks`` (long tensor ``[k]``) of the exact factor, ``[k, *output.shape]``
        (``divisor``: :meth:`divisor` of these arguments where the caller holds it, else None:
        a rule whose scale needs it computes it then)."""

    @abstractmethod
    def _sqrt_hessian_mc(self, loss_module, output, target, mc_samples, divisor):
        """Monte-Carlo factor ``[mc_samples, *output.shape]``, already scaled by 1/sqrt(M)
        (``divisor`` as in :meth:`_sqrt_hessian`)."""


class DiagonalLossRule(LossRule):
    """A loss with diagonal ``H_n = diag(r_n ** 2)``: exact column ``k`` is ``r_n[k] e_k``.

    ``K = P`` (one column per element of a sample).
    """

    elementwise = True

    def num_columns(self, loss_module, output):
        return math.prod(output.shape[1:])

    def _sqrt_hessian(self, loss_module, output, target, ks, divisor):
        r = self._sqrt_diagonal(loss_module, output, target).reshape(output.shape[0], -1)
        k = ks.shape[0]  # (``len``, a tensor's ``__len__``, is a Python call)
        factor = r.new_zeros(k, *r.shape)
        factor[torch.arange(k, device=ks.device), :, ks] = r[:, ks].T
        return factor.reshape(k, *output.shape)

    @abstractmethod
    def _sqrt_diagonal(self, loss_module, output, target):
        """``r`` of ``output``'s shape with ``H_n = diag(r[n].flatten() ** 2)``."""
