"""Per-module rules (one file per layer family), looked up with :func:`rule_for`.

Every module of this package is imported here, so a new layer type is added by adding one
module that defines a ``LayerRule`` subclass decorated with ``@register(TheModule)`` (or
``@register_name("TheClassName")``, or its qualified name, for another library's class). A
subclass that defines its own ``forward`` does not inherit its parent's rule
(``registry.rule_for``).
"""

import importlib
import pkgutil

from curvopt.layers.registry import LayerRule, mixes, mixing, register, register_name, rule_for

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["LayerRule", "mixes", "mixing", "register", "register_name", "rule_for"]
