"""Losses as likelihoods: square-root factors of a loss's Hessian w.r.t. its input.

``loss_rule_for(loss_module)`` returns the rule of a supported loss module
(``CrossEntropyLoss``, ``MSELoss``, ``BCEWithLogitsLoss``). Every module of this package is
imported here, so a new loss is added by adding one module that defines a ``LossRule``
subclass decorated with ``@register_loss_rule(TheLoss)``. A rule's ``check`` returns the loss's
divisor, which a pass hands to ``reduction_scale`` and the factors (``divisor=``, passed on to
the rule's ``_sqrt_hessian``/``_sqrt_hessian_mc``): the normaliser is read once a pass.
"""

import importlib
import pkgutil

from curvopt.losses.base import (
    DiagonalLossRule,
    LossRule,
    has_loss_rule,
    loss_rule_for,
    register_loss_rule,
)

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = [
    "DiagonalLossRule",
    "LossRule",
    "has_loss_rule",
    "loss_rule_for",
    "register_loss_rule",
]
