"""The producer table: for each ``extensions.Producer``, the parts of a pass that compute it.

A quantity's declaration names its producer (``Quantity.producer``); :data:`TABLE` maps the
producer to an :class:`Implementation`, the facts the pass reads to route its work, and the
pass loops over them: nothing else in curvopt compares producers. The parts, by event:

* the module hooks (``reducer``): the per-sample gradients ``g_n [N, *p]`` of each call and
  the reductions a value is made of (``reduces``: ``"batch"`` the ``g_n`` themselves,
  ``"l2"`` ``‖g_n‖²``, ``"sgs"`` ``Σ_n g_n²``, ``"total"`` ``Σ_n g_n``), or ``EKFAC``'s
  ``S = c · Σ_n (Q_0ᵀ G_n Q_1)²`` in eigenbases (``bases``);
* the loss hook (``curvature``): the loss's square-root columns propagated to each call's
  output, contributing diagonals (``columns="diagonal"``, ``diagonals``) or Kronecker factors
  (``columns="factors"``, ``kron_pass``; with ``bases``, those of ``EKFAC``'s fresh bases,
  made only where a basis is not supplied), then the work that walks on from the loss through
  the module calls themselves (``walks``; ``after``: DiagHessian's residual terms,
  ``hessian``, and the KFRA recursion, ``kfra``, in this order);
* ``coupled``: defined by a pass whose columns propagate through a module that mixes samples
  (:func:`coupled_estimate`): estimated without bias from Monte-Carlo columns, exact from
  exact columns of one row each;
* ``reference``: the second derivative ``curvopt.verify`` checks an exact diagonal against
  (``"ggn"``, ``"hessian"``), ``None`` where the quantity has none of its own.
"""

from __future__ import annotations

import dataclasses
import types
from functools import partial
from typing import Callable, Optional, Tuple

from curvopt.engine.hessian import residuals
from curvopt.engine.kfra import kfra
from curvopt.errors import UnsupportedLossError
from curvopt.extensions.quantity import Producer
from curvopt.graph.propagate import loss_gradient


def _residual_terms(context, loss, weight: float, calls, exts):
    """DiagHessian's residual terms (``hessian.residuals``) from the gradient w.r.t. the loss
    input of the loss ``loss`` entering the backward with the factor ``weight`` (computed only
    where a curved op needs it)."""
    if loss.no_hessian is not None:
        raise UnsupportedLossError(loss.no_hessian)
    return residuals(context, partial(loss_gradient, loss, weight), calls, exts)


def _recursion(context, loss, weight: float, calls, exts):
    """The KFRA recursion's factors (``kfra.kfra``), from the loss's exact columns."""
    return kfra(context, calls, exts)


@dataclasses.dataclass(frozen=True, eq=False)
class Implementation:
    """How a pass computes the quantities of one producer (the module docstring).

    Attributes:
        reduces: the per-sample reductions its value is made of, in order (a tuple value
            where several); empty where the module hooks compute nothing of it.
        bases: ``S`` in eigenbases: from the module hooks (``reducer``), with this pass's
            Kronecker factors made for the bases not supplied.
        columns: what the propagated loss columns contribute (``"diagonal"``,
            ``"factors"``), ``None`` where none.
        walks: the loss hook walks on through the module calls themselves (raw parameters are
            then computed by their modules' rules, ``parameter_sites``).
        after: ``after(context, loss, weight, calls, exts)``, the contributions made once the
            columns are done (``context``: the frozen ``LossContext``).
        coupled: defined by a coupled pass's columns (summed quantities only).
        reference: the second derivative ``verify`` compares an exact diagonal with.
    """

    reduces: Tuple[str, ...] = ()
    bases: bool = False
    columns: Optional[str] = None
    walks: bool = False
    after: Optional[Callable] = None
    coupled: bool = False
    reference: Optional[str] = None


#: producer -> its implementation; the order is that of the work in a pass
TABLE = types.MappingProxyType(
    {
        Producer.PER_SAMPLE_GRADIENTS: Implementation(reduces=("batch",)),
        Producer.SQUARED_NORMS: Implementation(reduces=("l2",)),
        Producer.SUM_OF_SQUARES: Implementation(reduces=("sgs",)),
        Producer.MOMENTS: Implementation(reduces=("sgs", "total")),
        Producer.GGN_DIAGONAL: Implementation(columns="diagonal", coupled=True, reference="ggn"),
        Producer.HESSIAN_DIAGONAL: Implementation(
            columns="diagonal", walks=True, after=_residual_terms, reference="hessian"
        ),
        Producer.KRONECKER: Implementation(columns="factors", coupled=True),
        Producer.KFRA: Implementation(walks=True, after=_recursion),
        Producer.EIGEN_CORRECTED: Implementation(bases=True, columns="factors", coupled=True),
    }
)


def coupled_estimate(ext) -> bool:
    """Whether ``ext`` is defined by a pass whose columns propagate through a module that
    mixes samples (``coupled``): a summed GGN diagonal, Kronecker factors or ``EKFAC``'s
    ``[S, *bases]`` (``S`` from the columns' batch gradients, ``curvature``), estimated
    without bias from sampled targets (``"mc"``) or exact (``"exact"``: ``R K`` columns of
    one row each, ``R`` rows of ``K`` columns)."""
    coupled = TABLE[ext.quantity.producer].coupled
    return ext.source in ("mc", "exact") and coupled and not ext.quantity.per_sample
