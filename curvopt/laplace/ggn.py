"""``CurvoptGGN``: laplace-torch's ``GGNInterface`` from curvopt's quantities.

* ``diag``: ``DiagGGNExact`` (``DiagGGNMC(mc_samples=num_samples)`` when ``stochastic``);
* ``kron``: ``KFLR`` (``KFAC(mc_samples=num_samples)``), with ``kfac_approx``;
* ``full``: laplace's ``J^T H J`` (or its Monte-Carlo Fisher) from the Jacobians, which are
  curvopt's per-sample gradients of each output (``jacobians``).

Any model curvopt supports works, attention, normalisation layers, tied weights and dict
inputs included; ``kron`` needs Kronecker factors for every parameter.
"""

from __future__ import annotations

from laplace.curvature import GGNInterface

from curvopt import extensions as ext
from curvopt.laplace.interface import CurvoptInterface


class CurvoptGGN(CurvoptInterface, GGNInterface):
    """The generalized Gauss-Newton matrix as laplace-torch's curvature (``backend=CurvoptGGN``).

    ``G = Σ_n J_nᵀ H_n J_n`` of laplace's summed loss (``J_n`` the Jacobian of the model output
    of sample ``n`` w.r.t. the parameters, ``H_n`` the loss Hessian w.r.t. that output), times
    ``factor``; with ``stochastic=True`` its Monte-Carlo Fisher from ``num_samples`` targets
    drawn from the model's predictive distribution (``E = G``). ``diag`` is ``DiagGGNExact``
    (``DiagGGNMC``), ``kron`` ``KFLR`` (``KFAC``) factors, ``full`` laplace's ``Jᵀ H J`` from the
    Jacobians (curvopt's per-sample gradients of each output).

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
        stochastic: the Monte-Carlo Fisher instead of the exact GGN (default ``False``).
        num_samples: targets drawn per sample when ``stochastic`` (default 1).
        kfac_approx: ``"expand"`` (default) or ``"reduce"``: how ``kron`` treats positions that
            share a weight (sequences, conv locations; Eschenhagen et al., 2023).

    Raises:
        ValueError: ``kfac_approx`` is not ``"expand"`` or ``"reduce"``.

    Example::

        from laplace import Laplace
        from curvopt.laplace import CurvoptGGN

        la = Laplace(model, "classification", subset_of_weights="all",
                     hessian_structure="kron", backend=CurvoptGGN)
        la.fit(train_loader)                       # KronLaplace from curvopt's KFLR factors
        la.optimize_prior_precision()
        probs = la(X_test, pred_type="glm")
    """

    def __init__(
        self,
        model,
        likelihood,
        last_layer: bool = False,
        subnetwork_indices=None,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        stochastic: bool = False,
        num_samples: int = 1,
        kfac_approx: str = "expand",
    ):
        CurvoptInterface.__init__(
            self,
            model,
            likelihood,
            last_layer,
            subnetwork_indices,
            dict_key_x,
            dict_key_y,
            kfac_approx=kfac_approx,
        )
        self.stochastic, self.num_samples = stochastic, num_samples  # GGNInterface's defaults

    def diag(self, x, y, **kwargs):
        """``(loss, diag(G) [P])``, both times ``factor``."""
        if self.stochastic:
            return self._diag(x, y, ext.DiagGGNMC(mc_samples=self.num_samples))
        return self._diag(x, y, ext.DiagGGNExact())

    def kron(self, x, y, N: int, **kwargs):
        """``(loss, Kron)``: KFLR (KFAC when ``stochastic``) factors, times ``factor``."""
        if self.stochastic:
            extension = ext.KFAC(mc_samples=self.num_samples, kfac_approx=self.kfac_approx)
        else:
            extension = ext.KFLR(kfac_approx=self.kfac_approx)
        return self._kron(x, y, N, extension)
