"""``fallback`` of the Kronecker optimizers ``KFAC`` and ``EKFAC``: parameters without a
Kronecker factorisation.

A ViT's class token and position embeddings (raw parameters), recurrent weights, or a weight
used non-linearly have no Kronecker factorisation. With a ``fallback`` the optimizers collect
with ``curvopt.collect(..., skip_unsupported=...)``, which leaves such parameters out of the
factors instead of raising, and step them as the ``fallback`` says:

* ``"diagonal"`` (the default): the damped diagonal Newton step ``d = g / (c + λ + δ)`` of
  ``DiagGGNNewton``, ``c`` the diagonal of the optimizer's own curvature, with the same ``λ``
  as the Kronecker blocks: the same scale as every other parameter's step, from the first
  step on. ``skip_unsupported="diagonal"`` writes it, the diagonal the extension declares as
  its ``fallback`` (:class:`DiagonalFallback`, :func:`fallback_diagonal`), from the columns
  the optimizer propagates anyway: ``p.kfac_diagonal`` (Monte-Carlo) or ``p.kflr_diagonal``
  (exact) for ``KFAC``, ``p.ekfac_diagonal`` for ``EKFAC`` (that of the factors its bases come
  from: ``curvature="kfac"`` Monte-Carlo, ``"kflr"`` exact), so that ``EKFAC``'s fallback step
  is ``KFAC``'s and ``DiagGGNNewton``'s. ``KFRA`` declares none: its parameters only skip.

  Between curvature updates (``curvature_interval > 1``) the last diagonal is reused.
* ``"sgd"``: the plain (weight-decayed) gradient, ``d = g``; no extra work.
* ``None``: raise (the backward pass's ``UnsupportedKroneckerError`` names the parameter and
  its module's path).

Why ``"diagonal"`` by default: with ``lr`` and ``damping`` chosen for Kronecker steps
(``(C + λ)⁻¹ g``, up to ``1/λ = 1000`` times ``g`` where the curvature is small) the plain
gradient is on another scale, far smaller, so such a parameter would barely train; the
diagonal step is on the blocks' scale at the cost of one more pass of the columns through the
owning module, for these parameters alone. An Adam-style ``d = g / (√v̂ + ε)`` is not offered:
its step per entry ignores the curvature scale, so it does not fit KFAC's learning rates.

Announced once: the first step that preconditions a parameter by its fallback warns, naming
the parameters (each optimizer names a parameter once, :func:`announce`); the collection's
own warning at every step is silenced while the optimizer collects
(``base.quiet_skips``). The collection options are ``base.skip_options``.
"""

from __future__ import annotations

import warnings

from curvopt import extensions
from curvopt.core import values
from curvopt.inversion.diagonal import diag_precondition


class DiagonalFallback:
    """``fallback='diagonal'`` of a Kronecker optimizer (a ``NewtonOptimizer`` subclass: this
    class first in its bases): the collection writes the diagonal the extension of each group
    declares (``writer.fallback``) for the parameters without factors
    (``NewtonOptimizer._collect_options``), and the step preconditions them by it
    (:func:`fallback_diagonal`); other fallbacks as the optimizer's base class has them."""

    def _fallback_writer(self, group, param):
        """The extension class whose declared diagonal steps ``param`` (default: that of the
        group's extension)."""
        return extensions.writer(self._extension(group)[0])

    def _fallback_available(self, update, group):
        if group["fallback"] != "diagonal":
            return super()._fallback_available(update, group)
        writer = self._fallback_writer(group, update.param)
        return has_diagonal(update.param, self.state.get(update.param, {}), writer)

    def _fallback_direction(self, item, step):
        if step.group["fallback"] != "diagonal":
            return super()._fallback_direction(item, step)
        writer = self._fallback_writer(step.group, item.update.param)
        return fallback_diagonal(self, item.update, item.grad, item.state, writer, step.damping)


def fallback_diagonal(optimizer, update, grad, state, writer, damping):
    """``(d, new state)``: ``d = g / (c + λ)`` with ``c`` the diagonal the extension class
    ``writer`` declares for parameters without factors (``writer.fallback``, e.g.
    ``p.kfac_diagonal``) when it is fresh, else the diagonal of the last update
    (``state["fallback_diagonal"]``)."""
    name = writer.fallback.attr
    param = update.param
    value = values.read(param, name)
    stale = value is None or value is optimizer._consumed.get(param, {}).get(name)
    diagonal = state.get("fallback_diagonal") if stale else None
    if diagonal is None:
        diagonal = optimizer._read(update, name, writer.__name__, None)
    update.checks.append((f"`{name}`", diagonal))
    return diag_precondition(grad, diagonal, damping), {"fallback_diagonal": diagonal}


def has_diagonal(param, state, writer) -> bool:
    """Whether ``param`` has the diagonal :func:`fallback_diagonal` reads: written by this
    pass (the engine skipped it for want of factors) or kept from an earlier one."""
    declared = getattr(writer, "fallback", None)  # KFRA declares none
    fresh = declared is not None and values.read(param, declared.attr) is not None
    return fresh or "fallback_diagonal" in state


def announce(owner: str, pending: dict[str, str], announced: set[str], stacklevel=3) -> None:
    """Warn once about the parameters ``pending`` (name -> its fallback) that an optimizer
    ``owner`` stepped by their fallback, less those it ``announced`` already (updated)."""
    pending = {name: f for name, f in pending.items() if name not in announced}
    for fallback in sorted(set(pending.values())):
        names = sorted(n for n, f in pending.items() if f == fallback)
        announced.update(names)
        how = {
            "diagonal": "by their diagonal curvature (fallback='diagonal', the default; see "
            "curvopt.optim.fallback)",
            "sgd": "by their plain gradient (fallback='sgd')",
            "adam": "by Adam in the identity basis (fallback='adam', EigenAdam's default)",
        }[fallback]
        warnings.warn(
            f"{owner}: parameters {names} have no Kronecker factorisation, so they are "
            f"preconditioned {how}. Pass fallback='sgd' or 'diagonal' to choose, or "
            "fallback=None to raise instead.",
            UserWarning,
            stacklevel=stacklevel,
        )
