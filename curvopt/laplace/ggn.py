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
    """The generalized Gauss-Newton matrix (``stochastic=True``: its Monte-Carlo Fisher with
    ``num_samples`` sampled targets) as laplace's curvature."""

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
