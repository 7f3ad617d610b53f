"""``CurvoptEF``: laplace-torch's ``EFInterface`` from curvopt's quantities.

The empirical Fisher ``sum_n g_n g_n^T`` of laplace's summed loss (``g_n`` the gradient of
sample ``n`` at its observed target), times ``factor``:

* ``diag``: ``SumGradSquared``;
* ``kron``: ``KFACEmpirical`` (Kronecker factors with the observed targets' loss gradient as
  the one column), with ``kfac_approx``;
* ``full``: laplace's ``sum_n g_n g_n^T`` from curvopt's per-sample gradients (``gradients``).
"""

from __future__ import annotations

from laplace.curvature import EFInterface

from curvopt import extensions as ext
from curvopt.laplace.interface import CurvoptInterface


class CurvoptEF(CurvoptInterface, EFInterface):
    """The empirical Fisher as laplace-torch's curvature (``backend=CurvoptEF``).

    ``EF = Σ_n g_n g_nᵀ`` of laplace's summed loss (``g_n`` the gradient of sample ``n`` at its
    observed target), times ``factor``: ``diag`` is ``SumGradSquared``, ``kron``
    ``KFACEmpirical`` factors, ``full`` laplace's ``Σ_n g_n g_nᵀ`` from curvopt's per-sample
    gradients.

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
        from curvopt.laplace import CurvoptEF

        la = Laplace(model, "classification", subset_of_weights="all",
                     hessian_structure="diag", backend=CurvoptEF)
        la.fit(train_loader)                       # DiagLaplace from p.sum_grad_squared
    """

    def diag(self, x, y, **kwargs):
        """``(loss, diag(EF) [P])``, both times ``factor``."""
        return self._diag(x, y, ext.SumGradSquared())

    def kron(self, x, y, N: int, **kwargs):
        """``(loss, Kron)``: ``KFACEmpirical`` factors, times ``factor``."""
        return self._kron(x, y, N, ext.KFACEmpirical(kfac_approx=self.kfac_approx))
