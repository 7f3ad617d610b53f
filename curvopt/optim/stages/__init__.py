"""The damped Newton step as a chain of small stages (see :mod:`curvopt.optim.stages.base`).

Every module of this package is imported here, so a stage is added by adding one module that
defines a :class:`Stage` subclass decorated with ``@register`` (its ``order`` places it).
"""

import importlib
import pkgutil

from curvopt.optim.stages.base import GroupStep, ParamStep, Stage, chain, register

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["GroupStep", "ParamStep", "Stage", "chain", "register"]
