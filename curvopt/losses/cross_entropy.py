"""Rule for ``torch.nn.CrossEntropyLoss`` on logits ``[N, C, *d]`` (``D = prod(d)`` positions).

At position ``d`` of sample ``n``, with ``p = softmax(x[n, :, d])``, the Hessian block is

    H_{n,d} = beta_{n,d} (diag(p) - p p^T) = beta_{n,d} sum_c p_c (e_c - p)(e_c - p)^T

and blocks of different positions do not interact. With class weights ``w`` (1 when absent)
and label smoothing ``eps``, ``beta = s * alpha`` where

* class-index target ``y``: ``alpha = (1 - eps) w_y + eps / C * sum_c w_c`` (0 where
  ``y == ignore_index``); "mean" has ``s = 1 / sum_{kept} w_y``;
* probability target ``t``: ``alpha = sum_c w_c t~_c``, ``t~ = (1 - eps) t + eps / C``
  (``alpha = 1`` for distributions without weights); "mean" has ``s = 1 / (N D)``;
* "sum" has ``s = 1``.

Exact factor: ``K = C D`` columns; column ``k = c D + d`` is ``sqrt(beta_{n,d} p_c) (e_c - p)``
at position ``d`` and zero elsewhere. MC: ``y' ~ Categorical(p)`` independently per position and
one column ``sqrt(beta_{n,d} / M) (e_{y'} - p)`` at every position; cross-position terms vanish
in expectation because the draws are independent and zero-mean.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from curvopt.errors import UnsupportedLossError
from curvopt.losses.base import LossRule, reduction_scale, register_loss_rule


@register_loss_rule(nn.CrossEntropyLoss)
class CrossEntropyLossRule(LossRule):
    def check_options(self, loss_module):
        super().check_options(loss_module)
        if loss_module.weight is not None and (loss_module.weight < 0).any():
            raise UnsupportedLossError(
                "CrossEntropyLoss with a negative class weight has a Hessian that is not "
                "positive semi-definite, so it has no square root; use nonnegative weights."
            )

    def _check_target(self, loss_module, output, target):
        shape = tuple(output.shape)
        if output.dim() < 2:
            raise ValueError(
                f"CrossEntropyLoss: input of shape {shape} has no batch dimension; curvopt needs "
                f"[N, C, *d], e.g. output.unsqueeze(0) and target.unsqueeze(0)."
            )
        if target.is_floating_point():
            if target.shape != output.shape:
                raise ValueError(
                    f"CrossEntropyLoss: probability targets must have the input's shape {shape}, "
                    f"got {tuple(target.shape)}."
                )
            if loss_module.ignore_index >= 0:
                raise ValueError(
                    "CrossEntropyLoss: ignore_index is not supported with probability targets "
                    "(as in torch); leave it at its default -100."
                )
        elif self._check_class_indices(loss_module, output, target):
            # every row kept at weight 1: the normaliser is the positions' count, >= 1
            return 1.0 if loss_module.reduction == "sum" else _counted_exactly(output)
        counted = self._alpha(loss_module, output, target)[1]  # checks the sign of alpha
        return 1.0 if loss_module.reduction == "sum" else float(_count(counted))

    @staticmethod
    def _check_class_indices(loss_module, output, target) -> bool:
        """Raise for class indices out of range; True where that check proves what
        :meth:`_beta` would check (every index in ``[0, C)``, ``ignore_index`` outside it, no
        class weights: alpha is 1 on every row, the normaliser their count)."""
        expected = (output.shape[0], *output.shape[2:])
        if target.dtype == torch.bool or target.is_complex():
            raise ValueError(
                f"CrossEntropyLoss: target must hold class indices (integer) or probabilities "
                f"(float), got {target.dtype}."
            )
        if tuple(target.shape) != expected:
            raise ValueError(
                f"CrossEntropyLoss: class-index target must have shape {expected} for input "
                f"{tuple(output.shape)}, got {tuple(target.shape)}."
            )
        low, high = torch.aminmax(target)
        if low.item() >= 0 and high.item() < output.shape[1]:  # the usual case: two reads
            ignored = 0 <= loss_module.ignore_index < output.shape[1]
            return loss_module.weight is None and not ignored
        bad = ((target < 0) | (target >= output.shape[1])) & (target != loss_module.ignore_index)
        if bad.any():
            raise ValueError(
                f"CrossEntropyLoss: class indices must lie in [0, {output.shape[1]}) or equal "
                f"ignore_index={loss_module.ignore_index}."
            )
        return False

    def _beta(self, loss_module, output, target, divisor):
        """``beta = s alpha`` of shape ``[N, D]`` (see module doc), ``s = 1 / divisor`` for
        "mean" (``divisor``: :meth:`divisor` of these arguments, computed here where None).
        Class indices without class weights or smoothing, counted by a "mean" at every position
        (:func:`_counted_exactly`), have ``alpha = 1``: ``beta = s`` without reading them."""
        plain = loss_module.weight is None and loss_module.label_smoothing == 0
        plain = plain and not target.is_floating_point()  # (soft targets: alpha = sum_c t_c)
        every = divisor is not None and divisor == _counted_exactly(output)
        if plain and every and loss_module.reduction == "mean":  # ("sum": its 1 counts none)
            batch = output.shape[0]
            return output.new_full((batch, _positions(output) // batch), 1.0 / divisor)
        alpha, counted = self._alpha(loss_module, output, target)
        if loss_module.reduction == "mean" and divisor is None:
            divisor = _count(counted)
        return alpha * reduction_scale(loss_module, divisor)

    def _mean_count(self, loss_module, output, target):
        """The normaliser of "mean": ``sum_{kept} w_y`` (the kept rows without class weights),
        ``N D`` for probability targets."""
        return _count(self._alpha(loss_module, output, target)[1])

    def _alpha(self, loss_module, output, target):
        """``(alpha [N, D], counted)``: the rows' weights, and the normaliser of "mean" as
        :func:`_count` reads it: ``N D`` for probability targets, else the kept rows' class
        weights ``w_y`` ``[N, D]`` (``alpha`` itself without class weights or smoothing)."""
        num_classes = output.shape[1]
        eps = loss_module.label_smoothing
        weight = loss_module.weight
        if weight is not None:
            weight = weight.to(output)
        elif target.is_floating_point() or eps != 0:  # (the usual case needs no weight)
            weight = output.new_ones(num_classes)
        if target.is_floating_point():
            probs = target.to(output).reshape(*output.shape[:2], -1)  # [N, C, D]
            alpha = (1 - eps) * torch.einsum("c,ncd->nd", weight, probs) + eps * weight.mean()
            counted = _positions(output)
            if (alpha < 0).any():
                raise UnsupportedLossError(
                    "CrossEntropyLoss: probability targets with sum_c weight_c * target_c < 0 "
                    "make the Hessian negative definite, so it has no square root; use "
                    "nonnegative probabilities."
                )
        else:  # nonnegative class weights (check_options): alpha >= 0
            labels = target.reshape(output.shape[0], -1)
            kept = labels != loss_module.ignore_index
            if loss_module.weight is None and eps == 0:  # the usual case: 1 where kept
                alpha = counted = kept.to(output.dtype)
            else:
                counted = torch.where(kept, weight[labels.where(kept, 0)], 0)
                alpha = (1 - eps) * counted + eps * weight.mean() * kept
        return alpha, counted

    def reduction_scale(self, loss_module, output, target, divisor=None) -> float:
        """``s = P / D``, ``P = output[:, 0].numel()`` the loss's positions (one class
        distribution each: ``N`` rows of ``[N, C]`` logits, ``N·T`` of ``[N, C, T]``) and ``D``
        its :meth:`divisor`: a position's curvature is one term, whatever the layout, so
        ``[N, C, T]`` logits and the same logits flattened to ``[N·T, C]`` give the same ``s``
        (1 for a mean over the kept positions, ``P`` for a sum); 0 when the mean counts none
        (``divisor`` as in :meth:`LossRule.reduction_scale`)."""
        if divisor is None:
            divisor = self.divisor(loss_module, output, target)
        return _positions(output) / divisor if divisor else 0.0

    def num_columns(self, loss_module, output):
        return math.prod(output.shape[1:])

    def _sqrt_hessian(self, loss_module, output, target, ks, divisor):
        batch, num_classes = output.shape[:2]
        k = ks.shape[0]  # (``len``, a tensor's ``__len__``, is a Python call)
        beta = self._beta(loss_module, output, target, divisor)  # [N, D]
        if math.prod(output.shape[2:]) == 1:  # one position: the columns are the factor
            p = output.softmax(1)
            p = p if p.dim() == 2 else p.reshape(batch, num_classes)  # [N, C]
            root = (beta * p).sqrt_()  # [N, C]
            if k == num_classes:  # every column, in order (the usual case)
                coeff, one_hot = root.T, torch.eye(num_classes, dtype=p.dtype, device=p.device)
            else:
                coeff, one_hot = root[:, ks].T, F.one_hot(ks, num_classes).to(output)
            # [k, N] · ([k, 1, C] - [N, C])
            columns = coeff.unsqueeze(2) * (one_hot.unsqueeze(1) - p)
            return columns if output.dim() == 2 else columns.reshape(k, *output.shape)
        probs = output.softmax(1).reshape(batch, num_classes, -1)  # [N, C, D]
        cs, ds = ks // probs.shape[2], ks % probs.shape[2]
        one_hot = F.one_hot(cs, num_classes).to(output)[:, None, :]  # [k, 1, C]
        coeff = (beta[:, ds] * probs[:, cs, ds]).sqrt().T  # [k, N]
        columns = coeff[..., None] * (one_hot - probs[:, :, ds].permute(2, 0, 1))  # [k, N, C]
        factor = output.new_zeros(k, *probs.shape)
        factor[torch.arange(k, device=ks.device), :, :, ds] = columns
        return factor.reshape(k, *output.shape)

    def _sqrt_hessian_mc(self, loss_module, output, target, mc_samples, divisor):
        batch, num_classes = output.shape[:2]
        probs = output.softmax(1).reshape(batch, num_classes, -1).transpose(1, 2)  # [N, D, C]
        beta = self._beta(loss_module, output, target, divisor)  # [N, D]
        sampled = _sample_classes(probs.reshape(-1, num_classes), mc_samples)
        # (one_hot - probs) * sqrt(beta / M), [M, N, D, C], made in place in one buffer
        columns = output.new_zeros(mc_samples, *probs.shape)
        columns.scatter_(-1, sampled.T.reshape(mc_samples, *beta.shape, 1), 1.0).sub_(probs)
        columns.mul_((beta / mc_samples).sqrt().unsqueeze(-1))
        return columns.transpose(2, 3).reshape(mc_samples, *output.shape)


def _positions(output: torch.Tensor) -> int:
    """``P = N prod(d)``, the positions of logits ``[N, C, *d]`` (``output[:, 0].numel()``)."""
    return output.shape[0] * math.prod(output.shape[2:])


def _counted_exactly(output: torch.Tensor):
    """The number of positions as "mean" counts them where every row is kept at weight 1: the
    sum of that many ones in ``output``'s dtype, ``float(P)`` where the dtype holds every
    integer up to ``P``; None beyond (where that sum rounds)."""
    positions = _positions(output)
    return float(positions) if positions <= 2 / torch.finfo(output.dtype).eps else None


def _count(counted) -> float:
    """The normaliser of "mean" from :meth:`CrossEntropyLossRule._alpha`'s ``counted`` (the
    positions, or the sum of the kept rows' class weights: one read); raises where it is 0."""
    if isinstance(counted, int):
        return counted
    count = counted.sum().item()
    if count == 0:
        raise ValueError(
            "CrossEntropyLoss(reduction='mean'): every target is ignore_index or has zero class "
            "weight, so the loss is 0/0 = nan; use reduction='sum' or keep a target."
        )
    return count


def _sample_classes(probs: torch.Tensor, samples: int) -> torch.Tensor:
    """``[R, samples]`` class indices drawn from the rows of ``probs`` (``[R, C]``) by inverting
    the cumulative distribution with ``u ~ U(0, c]``, ``c`` the row's last cumulative sum
    (``torch.multinomial`` is 5-25x slower on CPU). Scaling ``u`` by ``c`` (not 1: a softmax
    row sums to ``1 ± eps``) keeps ``u <= c``, so the index is in range and a class of
    probability 0 is never drawn; the clamp guards rows that are not finite."""
    cdf = probs.cumsum(1)
    u = 1 - torch.rand(probs.shape[0], samples, dtype=probs.dtype, device=probs.device)
    return torch.searchsorted(cdf, u.mul_(cdf[:, -1:])).clamp_(max=probs.shape[1] - 1)
