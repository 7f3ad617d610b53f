"""Per-module rules (one file per layer family), looked up with :func:`rule_for`."""

from curvopt.layers import (  # noqa: F401  (registration)
    conv,
    embedding,
    generic,
    linear,
    norm,
    recurrent,
    reparametrized,
    transposed_linear,
)
from curvopt.layers.registry import LayerRule, register, rule_for

__all__ = ["LayerRule", "register", "rule_for"]
