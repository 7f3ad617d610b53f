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
    """The empirical Fisher as laplace's curvature."""

    def diag(self, x, y, **kwargs):
        """``(loss, diag(EF) [P])``, both times ``factor``."""
        return self._diag(x, y, ext.SumGradSquared())

    def kron(self, x, y, N: int, **kwargs):
        """``(loss, Kron)``: ``KFACEmpirical`` factors, times ``factor``."""
        return self._kron(x, y, N, ext.KFACEmpirical(kfac_approx=self.kfac_approx))
