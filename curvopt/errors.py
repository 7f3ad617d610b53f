"""Exceptions raised by curvopt.

Every error names what is wrong (the module and its path in the model, the loss, the option)
and how to fix it. They derive from the built-in exception a user would expect, so
``except ValueError`` / ``except NotImplementedError`` keep working.
"""


class CurvoptError(Exception):
    """Base class of all curvopt errors."""


class UnsupportedModuleError(CurvoptError, NotImplementedError):
    """A module the requested quantity cannot be computed for."""


class UnsupportedKroneckerError(UnsupportedModuleError):
    """A parameter without a Kronecker factorisation (``collect(skip_unsupported=True)`` skips
    these)."""


class UnsupportedLossError(CurvoptError, ValueError):
    """A loss (or loss option, e.g. ``reduction='none'``) the quantity cannot handle."""


class ExtensionConflictError(CurvoptError, ValueError):
    """Extensions passed to one ``collect`` whose requirements conflict."""


class MissingLossError(CurvoptError, RuntimeError):
    """A second-order quantity was requested but the loss was not an extended loss module."""


class GraphReuseError(CurvoptError, RuntimeError):
    """A second backward pass inside ``collect`` through a graph whose inputs were released."""


def module_error(module, reason: str) -> UnsupportedModuleError:
    """``UnsupportedModuleError`` naming ``module`` by its path in the model and its type."""
    path = getattr(module, "_curvopt_path", type(module).__name__)
    return UnsupportedModuleError(
        f"curvopt cannot compute this for module {path!r} ({type(module).__name__}): {reason}"
    )


class AccumulationError(CurvoptError, RuntimeError):
    """Results of several backward passes in one ``collect`` that do not combine."""
