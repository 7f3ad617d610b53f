"""Normalisation layers with an elementwise affine map ``y = x_hat * w + b``.

``x_hat`` is recomputed from the input; the per-sample gradients are
``g_n(w) = sum_{positions} g_n * x_hat_n`` and ``g_n(b) = sum_{positions} g_n``, summed over the
dims of the output that the parameters do not index.

* ``LayerNorm``/``RMSNorm``: parameters index the trailing ``normalized_shape`` dims.
* ``GroupNorm``, ``BatchNorm{1,2,3}d`` (eval mode, running statistics): parameters index dim 1.
* ``InstanceNorm{1,2,3}d``: parameters index dim 1; each sample's own statistics (training
  mode, or ``track_running_stats=False``) or the running ones (eval mode). In training mode the
  running statistics are only updated, not used, so samples stay independent; the rule never
  re-runs the module (that would update them again).
* ``BatchNorm`` in training mode (or ``track_running_stats=False``) normalises with the batch's
  statistics, which mixes samples (``mixes_samples``): per-sample gradients do not exist and
  ``check`` says so. The rule still gives each sample's term of the batch gradient for a given
  output gradient, ``x_hat`` from the batch's statistics (``w`` and ``b`` act after the
  normalisation, so these terms sum to the exact gradient): the coupled curvature
  (``engine.curvature``, Monte-Carlo or exact) sums them over the batch before squaring.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from curvopt.errors import BATCH_STATISTICS
from curvopt.layers.eigenbasis import eigen_moment_of_vectors
from curvopt.layers.registry import LayerRule, register


class _AffineNormRule(LayerRule):
    def normalized(self, module, x: torch.Tensor) -> torch.Tensor:
        """``x_hat``, the input normalised without the affine map."""
        raise NotImplementedError

    def param_dims(self, module, grad: torch.Tensor):
        """Dims of the output indexed by the parameters."""
        return (1,)

    def batch_grad(self, call, name, out=None):
        g = call.grad_out
        if name == "weight":
            g = g * self.normalized(call.module, call.input)
        keep = set(self.param_dims(call.module, g)) | {0}
        summed = [d for d in range(g.dim()) if d not in keep]
        result = g.sum(summed) if summed else g
        if out is None:
            return result
        return out.copy_(result)

    def eigen_correction(self, call, name, bases):
        """A one-dimensional parameter shared over positions (output dims it does not index):
        ``Σ_n (Q_0ᵀ g_n)²`` by one product for the batch (``eigen_moment_of_vectors``)."""
        g, param = call.grad_out, call.module.get_parameter(name)
        shared = g.numel() > g.shape[0] * param.numel()
        if shared and param.dim() == 1 and len(bases) == 1:
            return eigen_moment_of_vectors(self.batch_grad(call, name), bases[0])
        return super().eigen_correction(call, name, bases)


@register(nn.LayerNorm)
class LayerNormRule(_AffineNormRule):
    positionwise = True

    def normalized(self, module, x):
        return F.layer_norm(x, module.normalized_shape, None, None, module.eps)

    def param_dims(self, module, grad):
        return range(grad.dim() - len(module.normalized_shape), grad.dim())


if hasattr(nn, "RMSNorm"):

    @register(nn.RMSNorm)
    class RMSNormRule(LayerNormRule):
        def normalized(self, module, x):
            return F.rms_norm(x, module.normalized_shape, None, module.eps)


@register(nn.GroupNorm)
class GroupNormRule(_AffineNormRule):
    def normalized(self, module, x):
        return F.group_norm(x, module.num_groups, None, None, module.eps)


@register(nn.modules.instancenorm._InstanceNorm)
class InstanceNormRule(_AffineNormRule):
    def normalized(self, module, x):
        if module.training or not module.track_running_stats:
            return F.instance_norm(x, eps=module.eps)
        return _running_normalized(module, x)


def _running_normalized(module, x):
    """``(x - running_mean) / sqrt(running_var + eps)``, statistics along dim 1."""
    shape = [1, -1] + [1] * (x.dim() - 2)
    mean = module.running_mean.view(shape)
    var = module.running_var.view(shape)
    return (x - mean) * torch.rsqrt(var + module.eps)


@register(nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
class BatchNormRule(_AffineNormRule):
    curvature_free = True  # eval mode: an affine map of the input

    def mixes_samples(self, module) -> bool:
        """Whether the module normalises with statistics of the whole batch (training mode, or
        ``track_running_stats=False``): its output for one sample depends on all of them."""
        return module.training or module.running_mean is None

    def check(self, module):
        if self.mixes_samples(module):
            return BATCH_STATISTICS
        return None

    def normalized(self, module, x):
        """With batch statistics: ``(x - mean) / sqrt(var + eps)`` by the forward's own kernel
        (``F.batch_norm`` without running statistics or affine map), so with the mean and
        variance the forward normalised with, bit for bit, at a quarter of the time of
        ``torch.var_mean`` and the formula (0.18 ms against 0.8 on ``[32, 16, 16, 16]``, one
        CPU thread)."""
        if self.mixes_samples(module):
            return F.batch_norm(x, None, None, training=True, eps=module.eps)
        return _running_normalized(module, x)

    def grad_sum(self, call, name):
        """With batch statistics: ``sum_n`` of the rows' terms on the whole call at once (a
        slice of the batch would have other statistics)."""
        if not self.mixes_samples(call.module):
            return None
        return self.batch_grad(call, name).sum(0)
