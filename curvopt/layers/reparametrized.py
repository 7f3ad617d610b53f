"""Modules whose parameters are reparametrized: ``torch.nn.utils.parametrizations.weight_norm``,
``spectral_norm``, any ``torch.nn.utils.parametrize`` function, and the older
``torch.nn.utils.weight_norm``/``spectral_norm`` hooks.

The layer multiplies by ``w = f(θ)`` (weight norm: ``θ = (g, v)``, ``w = g v / ||v||``), and the
per-sample quantities are those of the originals ``θ``, the parameters ``named_parameters()``
lists. The generic rule re-runs the whole module (parametrization included) on each sample with
``torch.func``, so ``g_n(θ) = (∂w/∂θ)^T g_n(w)`` is exact, and so are the GGN columns. The rule
owns the parametrization's submodules, whose calls (computing ``w``, no batch) are no samples.

Not supported (raising): spectral norm in training mode (each forward runs a power iteration
that updates buffers, so re-running it changes the layer); Kronecker factors of the originals
(``w`` is not linear in them); ``DiagHessian`` and ``KFRA`` (see ``hessian`` and ``kfra``).
"""

from __future__ import annotations

from curvopt.errors import module_error
from curvopt.layers.generic import GenericRule
from curvopt.layers.registry import register_reparametrized, reparametrization


#: the spectral-norm parametrization and the older hook
_SPECTRAL = {"_SpectralNorm", "SpectralNorm"}


class ReparametrizedRule(GenericRule):
    owns_children = True

    def check(self, module):
        reason = super().check(module)
        if reason is not None or not module.training:
            return reason
        functions = [
            f for fs in getattr(module, "parametrizations", {}).values() for f in fs
        ] + list(module._forward_pre_hooks.values())
        if any(type(f).__name__ in _SPECTRAL for f in functions):
            return (
                f"its reparametrized parameter {reparametrization(module)} is a spectral norm, "
                "whose power iteration in training mode cannot be re-run sample by sample. "
                "Call .eval() on the module for the pass (the power iteration stops)."
            )
        return None

    def kron_output_factor(self, call, columns, name, approx, n):
        if call.module.get_parameter(name).dim() == 1 or isinstance(columns, tuple):
            return None  # the exact block (layers.kron), or its single-output error
        raise module_error(
            call.module,
            f"parameter {name!r} is an original of the reparametrized parameter "
            f"{reparametrization(call.module)}, in which the weight is not linear, so it has no "
            "Kronecker factors. Use a diagonal quantity (DiagGGNExact, DiagGGNMC) or remove the "
            "parametrization; see docs/support.md#no-kronecker-factors.",
        )


REPARAMETRIZED = register_reparametrized(ReparametrizedRule())
