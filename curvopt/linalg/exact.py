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
    """The exact generalized Gauss-Newton matrix ``G`` of the loss on all of ``data``, ``(P, P)``.

    ``G = Σ_b w_b J_bᵀ (∇²_f L_b) J_b``, ``J_b`` the Jacobian of the loss input ``f`` of batch
    ``b`` w.r.t. the parameters, ``L_b`` the batch's loss as the loss module computes it (so
    with ``reduction="mean"`` it carries ``1/D``), batches weighted as in
    :class:`CurvatureOperator`. Matrix-vector products by forward mode where every op supports
    it, else reverse over reverse; the matrix is the same.

    Args:
        model: the model, extended by ``curvopt.extend`` (its trainable parameters, in
            ``model.parameters()`` order, give ``P``).
        lossfunc: the loss module, extended, with ``reduction="mean"`` or ``"sum"``.
        data: a re-iterable of ``(input, target)`` batches (a list, a ``DataLoader``); inputs
            may be tensors, tuples or dicts (``model(**inputs)``).
        output: ``None`` (default: the model's output, or the ``.logits`` of a ``ModelOutput``)
            or a callable picking the tensor the loss takes from the model's output.

    Raises:
        MissingLossError: ``lossfunc`` is not extended.
        UnsupportedLossError: a loss curvopt does not support.
        ValueError: the model is not extended, has no trainable parameter, or ``data`` is
            empty.

    Example:
        >>> import numpy as np, torch, curvopt
        >>> from curvopt import linalg
        >>> _ = torch.manual_seed(0)
        >>> model = curvopt.extend(torch.nn.Sequential(torch.nn.Linear(3, 2)))
        >>> lossfunc = curvopt.extend(torch.nn.CrossEntropyLoss())
        >>> data = [
        ...     (torch.randn(4, 3), torch.tensor([0, 1, 1, 0])),
        ...     (torch.randn(2, 3), torch.tensor([1, 0])),
        ... ]
        >>> G = linalg.GGN(model, lossfunc, data)
        >>> (G @ np.ones(8)).shape
        (8,)
        >>> np.allclose(G.to_dense(), G.to_dense().T)
        True
    """

    def output_operator(self, targets):
        return loss_hessian(self.loss(targets))


class EmpiricalFisher(_PerSample):
    """The empirical Fisher on all of ``data``, on the GGN's scale, ``(P, P)``.

    ``(1/N) Σ_n ∇ℓ_n ∇ℓ_nᵀ`` for ``reduction="mean"`` (``N`` all samples, ``ℓ_n`` the loss of
    sample ``n`` at its data target) and ``Σ_n ∇ℓ_n ∇ℓ_nᵀ`` for ``"sum"``.

    Args:
        model: the model, extended by ``curvopt.extend`` (its trainable parameters, in
            ``model.parameters()`` order, give ``P``).
        lossfunc: the loss module, extended, with ``reduction="mean"`` or ``"sum"``.
        data: a re-iterable of ``(input, target)`` batches (a list, a ``DataLoader``); inputs
            may be tensors, tuples or dicts (``model(**inputs)``).
        output: ``None`` (default: the model's output, or the ``.logits`` of a ``ModelOutput``)
            or a callable picking the tensor the loss takes from the model's output.

    Raises:
        MissingLossError: ``lossfunc`` is not extended.
        UnsupportedLossError: a loss curvopt does not support.
        UnsupportedModuleError: a module that mixes samples (BatchNorm in training mode).
        ValueError: the model is not extended, has no trainable parameter, or ``data`` is
            empty.

    Example:
        >>> import numpy as np, torch, curvopt
        >>> from curvopt import linalg
        >>> _ = torch.manual_seed(0)
        >>> model = curvopt.extend(torch.nn.Sequential(torch.nn.Linear(3, 2)))
        >>> lossfunc = curvopt.extend(torch.nn.CrossEntropyLoss())
        >>> data = [
        ...     (torch.randn(4, 3), torch.tensor([0, 1, 1, 0])),
        ...     (torch.randn(2, 3), torch.tensor([1, 0])),
        ... ]
        >>> EF = linalg.EmpiricalFisher(model, lossfunc, data)
        >>> bool(np.linalg.eigvalsh(EF.to_dense()).min() > -1e-6)  # positive semi-definite
        True
    """

    def weight(self, output, targets) -> float:
        """``R_b``: the matrix of each batch is scaled by its rows (``M_r`` times ``R_b``), so
        batches weigh by their rows."""
        return output.shape[0]

    def output_operator(self, targets):
        def operator(output):
            gradient = grad(self.loss(targets))(output)
            scale = output.shape[0] if self.mean else 1
            outer = per_row_outer(gradient[None])
            return lambda u: scale * outer(u)

        return operator


class FisherMC(_PerSample):
    """The Monte-Carlo Fisher on all of ``data``: ``E[FisherMC] = G``, ``(P, P)``.

    The empirical Fisher at ``mc_samples`` targets per sample drawn from the model's predictive
    distribution (as ``DiagGGNMC``/``KFAC`` draw them), scaled like ``G``, so that its
    expectation is the GGN. The draws are fixed by ``seed`` (the same matrix on every product);
    the global RNG state is left untouched.

    Args:
        model: the model, extended by ``curvopt.extend`` (its trainable parameters, in
            ``model.parameters()`` order, give ``P``).
        lossfunc: the loss module, extended, with ``reduction="mean"`` or ``"sum"``.
        data: a re-iterable of ``(input, target)`` batches (a list, a ``DataLoader``); inputs
            may be tensors, tuples or dicts (``model(**inputs)``).
        mc_samples: targets drawn per sample (default 1).
        seed: the seed of the draws (default 0).
        output: ``None`` (default: the model's output, or the ``.logits`` of a ``ModelOutput``)
            or a callable picking the tensor the loss takes from the model's output.

    Raises:
        MissingLossError: ``lossfunc`` is not extended.
        UnsupportedLossError: a loss curvopt does not support.
        UnsupportedModuleError: a module that mixes samples (BatchNorm in training mode).
        ValueError: ``mc_samples`` is not a positive int, the model is not extended, has no
            trainable parameter, or ``data`` is empty.

    Example:
        >>> import numpy as np, torch, curvopt
        >>> from curvopt import linalg
        >>> _ = torch.manual_seed(0)
        >>> model = curvopt.extend(torch.nn.Sequential(torch.nn.Linear(3, 2)))
        >>> lossfunc = curvopt.extend(torch.nn.CrossEntropyLoss())
        >>> data = [
        ...     (torch.randn(4, 3), torch.tensor([0, 1, 1, 0])),
        ...     (torch.randn(2, 3), torch.tensor([1, 0])),
        ... ]
        >>> F = linalg.FisherMC(model, lossfunc, data, mc_samples=1, seed=0)
        >>> np.allclose(F @ np.ones(8), F @ np.ones(8))  # the same draws on every product
        True
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
    """The Hessian ``∇²_θ L`` of the loss on all of ``data``, ``(P, P)``.

    Including the curvature of the network itself (unlike :class:`GGN`); batches weighted as
    in :class:`CurvatureOperator`. Products by double backward per batch.

    Args:
        model: the model, extended by ``curvopt.extend`` (its trainable parameters, in
            ``model.parameters()`` order, give ``P``).
        lossfunc: the loss module, extended, with ``reduction="mean"`` or ``"sum"``.
        data: a re-iterable of ``(input, target)`` batches (a list, a ``DataLoader``); inputs
            may be tensors, tuples or dicts (``model(**inputs)``).
        output: ``None`` (default: the model's output, or the ``.logits`` of a ``ModelOutput``)
            or a callable picking the tensor the loss takes from the model's output.

    Raises:
        MissingLossError: ``lossfunc`` is not extended.
        UnsupportedLossError: a loss curvopt does not support.
        ValueError: the model is not extended, has no trainable parameter, or ``data`` is
            empty.

    Example:
        >>> import numpy as np, torch, curvopt
        >>> from curvopt import linalg
        >>> _ = torch.manual_seed(0)
        >>> model = curvopt.extend(torch.nn.Sequential(torch.nn.Linear(3, 2)))
        >>> lossfunc = curvopt.extend(torch.nn.CrossEntropyLoss())
        >>> data = [
        ...     (torch.randn(4, 3), torch.tensor([0, 1, 1, 0])),
        ...     (torch.randn(2, 3), torch.tensor([1, 0])),
        ... ]
        >>> H = linalg.Hessian(model, lossfunc, data)
        >>> G = linalg.GGN(model, lossfunc, data)
        >>> np.allclose(H.to_dense(), G.to_dense(), atol=1e-6)  # a linear model: H = G
        True
    """

    def _batch_matmat(self, inputs, targets, vectors):
        forward = model_function(self.model, self.names, inputs, self.output)
        loss = lambda output: self.lossfunc(output, targets)
        return hessian_matmat(forward, loss, self.params, vectors)
