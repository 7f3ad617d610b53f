"""``phi''(u)`` of the curved elementwise ops, read off their autograd nodes' saved tensors
(``hessian``, ``DiagHessian``): by node class name, from the saved result or by differentiating
the op twice at its saved input (``tests/test_torch_internals.py`` checks the names)."""

from __future__ import annotations

from typing import Callable, Dict

import torch
import torch.nn.functional as F


def _from_result(fn: Callable) -> Callable:
    return lambda node: fn(node._saved_result)


def _from_input(make: Callable) -> Callable:
    """``phi''(u)`` by double differentiation of ``make(node)(u)``, ``u`` the saved input."""

    def second(node):
        u = node._saved_self.detach().requires_grad_(True)
        with torch.enable_grad():
            (d1,) = torch.autograd.grad(make(node)(u).sum(), u, create_graph=True)
            (d2,) = torch.autograd.grad(d1.sum(), u)
        return d2

    return second


#: autograd node type -> phi''(u) of the elementwise op it belongs to
SECOND_DERIVATIVES: Dict[str, Callable] = {
    "SigmoidBackward0": _from_result(lambda s: s * (1 - s) * (1 - 2 * s)),
    "TanhBackward0": _from_result(lambda t: -2 * t * (1 - t * t)),
    "GeluBackward0": _from_input(lambda n: lambda u: F.gelu(u, approximate=n._saved_approximate)),
    "SiluBackward0": _from_input(lambda n: F.silu),
    "MishBackward0": _from_input(lambda n: F.mish),
    "LogSigmoidBackward0": _from_input(lambda n: F.logsigmoid),
    "SoftplusBackward0": _from_input(
        lambda n: lambda u: F.softplus(u, n._saved_beta, n._saved_threshold)
    ),
    "CeluBackward0": _from_input(lambda n: lambda u: F.celu(u, n._saved_alpha)),
    "EluBackward0": _from_input(
        lambda n: (
            lambda u: (
                float(n._saved_scale)
                * F.elu(u * float(n._saved_input_scale), float(n._saved_alpha))
            )
        )
    ),
}
