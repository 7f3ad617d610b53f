"""What both curvopt backends of laplace-torch share: the model's forward, one collected pass.

laplace's conventions (``laplace.curvature.CurvatureInterface``): the loss is
``CrossEntropyLoss(reduction="sum")`` (classification; logits ``[..., C]`` flattened to rows) or
``MSELoss(reduction="sum")`` (regression), and every curvature is returned times ``factor``
(1, or ``1/2`` for the Gaussian ``N(f, 1)`` from ``MSELoss``), with the loss times ``factor``.
Vectors are over ``self.params`` (the trainable parameters of the model, or of its last layer),
each ``vec(p)`` row-major, restricted to ``subnetwork_indices`` where given.

Kronecker factors (``Kron``) are in ``p``'s dim order, so ``kron(F_0, F_1)`` is indexed like
``vec(p)``; the input-side factor (an average over the batch's ``M`` samples) is rescaled by
``M / N``, so that laplace's factor-wise sum over the batches of a data set of ``N`` samples
is the output side's sum with the input side's average over all samples. A grouped
convolution's factors (one block per group) do not fit ``Kron`` and raise, naming the module.
"""

from __future__ import annotations

from collections.abc import MutableMapping

import torch
from laplace.curvature import CurvatureInterface
from laplace.utils import Kron

import curvopt
from curvopt import extensions as ext
from curvopt.errors import module_error
from curvopt.layers.kron import output_factor_index


class CurvoptInterface(CurvatureInterface):
    """What both curvopt backends of laplace-torch share: model, loss and one collected pass.

    Model, loss and parameters as laplace sets them (``laplace.curvature.CurvatureInterface``);
    curvature from ``curvopt.collect``, returned times laplace's ``factor`` with the loss.
    Vectors are over ``self.params`` (all trainable parameters, or the last layer's), each
    ``vec(p)`` row-major. Kronecker factors are in ``p``'s dim order, the input side rescaled by
    ``M / N`` (``M`` the batch, ``N`` the data set) so that laplace's sum over batches is right.
    Use a subclass: :class:`~curvopt.laplace.CurvoptGGN` or :class:`~curvopt.laplace.CurvoptEF`.

    Args:
        model: the model (laplace passes it; ``curvopt.extend`` is applied to it here).
        likelihood: ``"classification"`` (loss ``CrossEntropyLoss(reduction="sum")``, logits
            ``[..., C]`` flattened to rows) or ``"regression"`` (``MSELoss(reduction="sum")``,
            ``factor = 1/2``).
        last_layer: curvature of the last layer only, on the model's (constant) features.
        subnetwork_indices: ``None`` or the indices (into the flattened parameters) of a
            subnetwork to restrict every vector to.
        dict_key_x: the key of the input in dict (Hugging Face) batches (default
            ``"input_ids"``).
        dict_key_y: the key of the targets in dict batches (default ``"labels"``).
        kfac_approx: ``"expand"`` (default) or ``"reduce"``: how ``kron`` treats positions that
            share a weight (sequences, conv locations; Eschenhagen et al., 2023).

    Raises:
        ValueError: ``kfac_approx`` is not ``"expand"`` or ``"reduce"``.

    Example::

        from laplace import Laplace
        from curvopt.laplace import CurvoptEF, CurvoptGGN, CurvoptInterface

        issubclass(CurvoptGGN, CurvoptInterface) and issubclass(CurvoptEF, CurvoptInterface)  # True
    """

    def __init__(
        self,
        model,
        likelihood,
        last_layer: bool = False,
        subnetwork_indices=None,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        kfac_approx: str = "expand",
    ):
        super().__init__(model, likelihood, last_layer, subnetwork_indices, dict_key_x, dict_key_y)
        if kfac_approx not in ("expand", "reduce"):
            raise ValueError(
                f"{type(self).__name__}: kfac_approx must be 'expand' or 'reduce', "
                f"got {kfac_approx!r}"
            )
        self.kfac_approx = kfac_approx
        curvopt.extend(self.model)
        self.lossfunc = curvopt.extend(self.lossfunc)

    # ------------------------------------------------------------------------- one pass

    def _forward(self, x):
        """The model output; for last-layer use the last layer on the (constant) features."""
        if not self.last_layer:
            return self.model(x)
        with torch.no_grad():
            _, features = self.model.forward_with_features(x)
        return self._model(features)

    def _loss(self, f, y):
        """laplace's loss: class logits ``[..., C]`` flattened to rows, as its backends do."""
        if self.likelihood == "classification":
            f, y = f.reshape(-1, f.shape[-1]), y.reshape(-1)
        return self.lossfunc(f, y)

    def _batch_size(self, x) -> int:
        return (x[self.dict_key_x] if isinstance(x, MutableMapping) else x).shape[0]

    def _collected(self, scalar, *extensions):
        """Backpropagate ``scalar`` into ``self.params`` only within ``collect(*extensions)``,
        their gradients left as they were; ``{attr: [value of p.attr for p in self.params]}``,
        ``None`` for a parameter that ``scalar`` does not depend on (its curvature is zero)."""
        saved = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        try:
            with curvopt.collect(*extensions):
                torch.autograd.backward(scalar, inputs=self.params)
            return {e.attr: [_pop(p, e.attr) for p in self.params] for e in extensions}
        finally:
            for p, g in zip(self.params, saved):
                p.grad = g

    def _pass(self, x, y, extension):
        """``(loss, [p.<attr> for p in self.params])`` of laplace's loss on ``(x, y)``."""
        loss = self._loss(self._forward(x), y)
        return loss.detach(), self._collected(loss, extension)[extension.attr]

    def _vector(self, values, batched=False) -> torch.Tensor:
        """Per-parameter values concatenated (``[P]``, or ``[N, P]`` when ``batched``) and
        restricted to ``subnetwork_indices``."""
        start = 1 if batched else 0
        batch = next((v.shape[0] for v in values if v is not None), 0) if batched else None
        vec = torch.cat(
            [
                (_zeros(p, batch) if v is None else v).flatten(start_dim=start)
                for p, v in zip(self.params, values)
            ],
            dim=start,
        )
        if self.subnetwork_indices is not None:
            vec = vec[..., self.subnetwork_indices]
        return vec

    # ------------------------------------------------------------------------- laplace's API

    def selected_output_jacobians(self, x, outputs, enable_backprop: bool = False):
        """``(Js [N, S, P], f [N, C])``: ``Js[n, s] = d f[n, outputs[n, s]] / d θ``, one
        forward and backward pass of ``BatchGrad`` per selected column."""
        if enable_backprop:  # differentiable Jacobians: torch.func
            return super().selected_output_jacobians(x, outputs, enable_backprop=True)
        batch = self._batch_size(x)
        outputs = outputs[:, None] if outputs.ndim == 1 else outputs
        if outputs.shape[0] != batch:
            raise ValueError(
                f"{type(self).__name__}: {outputs.shape[0]} output selectors for a batch of "
                f"{batch}; give one row of output indices per input"
            )
        columns = []
        for s in range(outputs.shape[1]):
            f = self._forward(x)
            flat = f.reshape(batch, -1)
            index = outputs[:, s : s + 1].to(flat.device, dtype=torch.long)
            grads = self._collected(flat.gather(1, index).sum(), ext.BatchGrad())
            columns.append(self._vector(grads["grad_batch"], batched=True))
        return torch.stack(columns, dim=1), f.detach()

    def jacobians(self, x, enable_backprop: bool = False):
        """``(Js [N, C, P], f [N, C])``, the Jacobians of every output (``C`` passes)."""
        if enable_backprop:
            return super().jacobians(x, enable_backprop=True)
        with torch.no_grad():
            width = self._forward(x).reshape(self._batch_size(x), -1).shape[1]
        outputs = torch.arange(width).expand(self._batch_size(x), width)
        return self.selected_output_jacobians(x, outputs)

    def gradients(self, x, y):
        """``(Gs [N, P], loss)``: per-sample gradients of laplace's (summed) loss."""
        loss, grads = self._pass(x, y, ext.BatchGrad())
        return self._vector(grads, batched=True), loss

    def _diag(self, x, y, extension):
        """``(factor * loss, factor * diagonal [P])`` from ``extension``'s diagonal."""
        loss, values = self._pass(x, y, extension)
        return self.factor * loss, self.factor * self._vector(values)

    def _kron(self, x, y, N: int, extension):
        """``(factor * loss, factor * Kron)`` from ``extension``'s Kronecker factors."""
        if self.subnetwork_indices is not None:
            raise ValueError(
                f"{type(self).__name__}.kron: Kronecker factors cover whole parameters, not a "
                "subnetwork; use hessian_structure='full' (or 'diag') with subnetwork_indices"
            )
        loss, values = self._pass(x, y, extension)
        scale = self._batch_size(x) / N
        owners = _owners(self._model)
        kfacs = []
        for p, factors in zip(self.params, values):
            if factors is None:  # not used by the output: zero factors of laplace's shapes
                factors = [p.new_zeros(n, n) for n in _factor_sizes(p)]
            factors = [f.detach() for f in factors]
            if factors[0].dim() == 3:
                raise _grouped_error(type(self).__name__, owners[id(p)][0], len(factors[0]))
            if len(factors) == 2:
                module, name = owners[id(p)]
                inside = 1 - output_factor_index(module, name)
                factors[inside] = factors[inside] * scale
            kfacs.append(factors)
        return self.factor * loss, Kron(kfacs) * self.factor


def _grouped_error(backend: str, module, groups: int):
    """A grouped convolution's factors (one block per group, ``[G, d, d]``) have no place in
    laplace-torch's ``Kron``, which holds one Kronecker product (or one matrix) per parameter,
    its shapes fixed by ``Kron.init_from_model``."""
    return module_error(
        module,
        f"{backend}.kron: its {groups} groups each have their own Kronecker block, and "
        "laplace-torch's Kron holds one Kronecker product per parameter. Use "
        "hessian_structure='diag' or 'full' for this model, or groups=1.",
    )


def _pop(p, attr):
    """``p.<attr>``, removed from ``p``; ``None`` where the pass did not reach ``p``."""
    if not hasattr(p, attr):
        if p.grad is not None:  # reached, yet nothing written: never silently zero
            raise RuntimeError(
                f"curvopt.laplace: a parameter of shape {tuple(p.shape)} got no {attr}"
            )
        return None
    value = getattr(p, attr)
    delattr(p, attr)
    return value


def _zeros(p, batch):
    """The zero value of a parameter the output does not depend on (``[batch, *p]`` or ``p``)."""
    return p.new_zeros(p.shape if batch is None else (batch, *p.shape))


def _factor_sizes(p):
    """laplace's Kronecker factor sizes for ``p``: ``[numel]`` (one-dimensional) or
    ``[p.shape[0], numel / p.shape[0]]``."""
    return [p.numel()] if p.dim() == 1 else [p.shape[0], p[0].numel()]


def _owners(model) -> dict:
    """``id(p) -> (module, name)``: the first module holding each parameter directly."""
    owners = {}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), (module, name))
    return owners
