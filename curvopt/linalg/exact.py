"""Curvature matrices by automatic differentiation: exact GGN, Hessian, empirical and MC Fisher.

All are ``Jᵀ M J`` on the loss input ``f`` (rows ``r`` of dim 0 the samples, ``L_b`` the loss
of batch ``b`` as the loss module computes it), except the Hessian:

* ``GGN``: ``M = ∇²_f L_b``;
* ``EmpiricalFisher``: ``M_r = c_r c_rᵀ`` (times ``R_b`` for "mean"), ``c = ∇_f L_b`` at the
  data's targets; so ``(1/R) Σ_r ∇ℓ_r ∇ℓ_rᵀ`` for "mean", ``Σ_r ∇ℓ_r ∇ℓ_rᵀ`` for "sum";
* ``FisherMC``: ``M_r = Σ_m s_mr s_mrᵀ``, ``s`` the loss rule's Monte-Carlo square-root factor
  (gradients at targets sampled from the model's predictive distribution, scaled like
  ``∇²_f L_b``); ``E[M] = ∇²_f L_b``, so ``E[FisherMC] = GGN``;
* ``Hessian``: ``∇²_θ L``, including the curvature of the network itself.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import grad

from curvopt.errors import UnsupportedModuleError
from curvopt.linalg.autodiff import (
    OutputProducts,
    hessian_matmat,
    loss_hessian,
    model_function,
    per_row_outer,
)
from curvopt.linalg.base import CurvatureOperator
from curvopt.losses import loss_rule_for


class _OutputCurvature(CurvatureOperator):
    """``Σ_b Jᵀ M_b J`` (weighted as in :mod:`curvopt.linalg.base`); subclasses give ``M_b``.
    ``J V`` by forward mode where the model supports it (:class:`OutputProducts`)."""

    def __init__(self, model, lossfunc, data, output=None):
        super().__init__(model, lossfunc, data, output)
        self.products = OutputProducts()

    def output_operator(self, targets):
        """``f ↦ (u ↦ M_b u)`` for the batch with ``targets``."""
        raise NotImplementedError

    def _batch_matmat(self, inputs, targets, vectors):
        forward = model_function(self.model, self.names, inputs, self.output)
        return self.products(forward, self.params, vectors, self.output_operator(targets))

    def loss(self, targets):
        return lambda output: self.lossfunc(output, targets)


class _PerSample(_OutputCurvature):
    """Curvature built from per-sample outer products: samples must not interact."""

    def __init__(self, model, lossfunc, data, output=None):
        for name, module in model.named_modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training:
                raise UnsupportedModuleError(
                    f"curvopt.linalg.{type(self).__name__}: module {name!r} "
                    f"({type(module).__name__}) is in train mode and mixes the samples of a "
                    "batch, so per-sample gradients are undefined; call model.eval() first"
                )
        super().__init__(model, lossfunc, data, output)


class GGN(_OutputCurvature):
    """Exact generalized Gauss-Newton matrix ``G = Σ_b Jᵀ ∇²_f L_b J`` (weighted over batches)."""

    def output_operator(self, targets):
        return loss_hessian(self.loss(targets))


class EmpiricalFisher(_PerSample):
    """``(1/R) Σ_r ∇ℓ_r ∇ℓ_rᵀ`` ("mean") or ``Σ_r ∇ℓ_r ∇ℓ_rᵀ`` ("sum"), ``ℓ_r`` the loss of
    sample ``r`` at its data target."""

    def output_operator(self, targets):
        def operator(output):
            gradient = grad(self.loss(targets))(output)
            scale = output.shape[0] if self.mean else 1
            outer = per_row_outer(gradient[None])
            return lambda u: scale * outer(u)

        return operator


class FisherMC(_PerSample):
    """Monte-Carlo Fisher: the empirical Fisher at ``mc_samples`` targets per sample drawn from
    the model's predictive distribution (as ``DiagGGNMC``/``KFAC`` draw them); ``E = G``.

    The draws are fixed by ``seed`` (the same matrix on every product); the global RNG state
    is left untouched.
    """

    def __init__(self, model, lossfunc, data, mc_samples: int = 1, seed: int = 0, output=None):
        super().__init__(model, lossfunc, data, output)
        if isinstance(mc_samples, bool) or not isinstance(mc_samples, int) or mc_samples < 1:
            raise ValueError(f"FisherMC: mc_samples must be a positive int, got {mc_samples!r}")
        self.mc_samples, self.seed = mc_samples, seed

    def output_operator(self, targets):
        def operator(output):
            rule = loss_rule_for(self.lossfunc)
            columns = rule.sqrt_hessian_mc(self.lossfunc, output, targets, self.mc_samples)
            return per_row_outer(columns)

        return operator

    def _apply(self, matrix):
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(self.seed)
            return super()._apply(matrix)


class Hessian(CurvatureOperator):
    """Hessian ``∇²_θ L`` of the loss on all of ``data`` (double backward per batch)."""

    def _batch_matmat(self, inputs, targets, vectors):
        forward = model_function(self.model, self.names, inputs, self.output)
        loss = lambda output: self.lossfunc(output, targets)
        return hessian_matmat(forward, loss, self.params, vectors)
