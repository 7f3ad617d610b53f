"""Exceptions raised by curvopt.

Every error says in two sentences what is wrong (the module and its path in the model, the loss,
the option) and how to fix it; the details are in ``docs/support.md`` ("Errors and their
fixes"), which the messages link to. They derive from the built-in exception a user would
expect, so ``except ValueError`` / ``except NotImplementedError`` keep working.
"""


class CurvoptError(Exception):
    """Base class of all curvopt errors."""


class UnsupportedModuleError(CurvoptError, NotImplementedError):
    """A module the requested quantity cannot be computed for."""


class UnsupportedKroneckerError(UnsupportedModuleError):
    """A parameter without a Kronecker factorisation (``collect(skip_unsupported=True)`` skips
    these). ``cause``: the one-sentence reason, without the parameter's name or path, that
    ``collect(...).skipped`` lists (the whole message where none was given)."""

    def __init__(self, message: str = "", cause: str = ""):
        super().__init__(message)
        self.cause = cause or message


class UnsupportedLossError(CurvoptError, ValueError):
    """A loss (or loss option, e.g. ``reduction='none'``) the quantity cannot handle."""


class ExtensionConflictError(CurvoptError, ValueError):
    """Extensions passed to one ``collect`` whose requirements conflict."""


class MissingLossError(CurvoptError, RuntimeError):
    """A second-order quantity was requested but the loss was not an extended loss module."""


class GraphReuseError(CurvoptError, RuntimeError):
    """A second backward pass inside ``collect`` through a graph whose inputs were released."""


def module_error(module, reason: str) -> UnsupportedModuleError:
    """``UnsupportedModuleError`` naming ``module`` by its path in the model and its type;
    ``reason``: what is wrong, then the fix (two sentences, see the module doc)."""
    return UnsupportedModuleError(f"{_module_prefix(module)}: {reason}")


#: the fix in :data:`BATCH_STATISTICS` in the terms of ``collect``'s user (extension classes);
#: an optimizer's user reads its own argument instead (:func:`in_optimizer_terms`)
BATCH_STATISTICS_FIX = (
    "Call model.eval() (running statistics) or use a Monte-Carlo curvature (DiagGGNMC, KFAC)"
)
#: the reason of every module that normalises with the batch's statistics (BatchNorm in training
#: mode), whatever asked for a quantity it has not: the same message from every entry point
#: (an optimizer's phrased in its own terms)
BATCH_STATISTICS = (
    "it normalises with statistics of the whole batch, which mixes samples. "
    f"{BATCH_STATISTICS_FIX}; see docs/support.md#batchnorm-in-training-mode."
)


def in_optimizer_terms(error: BaseException, optimizer: str, monte_carlo: str | None):
    """``error`` as the user of the optimizer ``optimizer`` (its class name) must act on it:
    where its fix names extension classes (:data:`BATCH_STATISTICS_FIX`), an error of the same
    type whose fix names the optimizer's argument instead (``curvature=monte_carlo``, its
    Monte-Carlo choice; ``None``: the optimizer has none); any other error unchanged."""
    message = str(error)
    if not isinstance(error, CurvoptError) or BATCH_STATISTICS_FIX not in message:
        return error
    fix = "Call model.eval() (running statistics)"
    if monte_carlo is not None:
        fix += f" or pass {optimizer}(..., curvature={monte_carlo!r}), a Monte-Carlo curvature"
    return type(error)(message.replace(BATCH_STATISTICS_FIX, fix))


#: the fix of every parameter without Kronecker factors (``kronecker_error``)
NO_KRONECKER_FIX = (
    "Use a diagonal quantity, collect(..., skip_unsupported=True) or "
    "optim.KFAC(fallback='diagonal'); see docs/support.md#no-kronecker-factors"
)


def kronecker_error(module, what: str, cause: str) -> UnsupportedKroneckerError:
    """``UnsupportedKroneckerError`` for ``what`` (a parameter of ``module``, named) without
    Kronecker factors; ``cause``: why, in words that hold for every parameter with that cause
    (no name, no path: ``collect(...).skipped`` groups the parameters by it)."""
    return UnsupportedKroneckerError(
        f"{_module_prefix(module)}: {what} has no Kronecker factorisation ({cause}). "
        f"{NO_KRONECKER_FIX}.",
        cause=f"{type(module).__name__}: {cause}",
    )


def batch_mismatch(module, batch_dim: int, n: int, seen: int) -> UnsupportedModuleError:
    """The error for a module call that sees ``n`` samples on ``batch_dim`` where the others
    saw ``seen``, be the batch found without the loss (``guards.pass_guards``) or from it
    (``engine.rows``)."""
    return module_error(
        module,
        f"it sees {n} samples on dim {batch_dim} but other modules saw {seen}. Keep the "
        "batch dim intact (do not fold it; sequence-first models: extend the loss, or "
        "curvopt.extend(model, sequence_first=True)); see docs/support.md#the-batch-dimension.",
    )


def _type_name(module) -> str:
    return type(module).__name__


#: how an error names a module: by its path in the model, which ``curvopt.core.extended`` keeps
#: (a layer above this one, which it cannot import: that module installs its lookup here when
#: it is imported, :func:`name_modules_by`); by its type's name until then
_PATH_OF = [_type_name]


def name_modules_by(path_of) -> None:
    """Name modules in errors by ``path_of(module)`` (``curvopt.core.extended.module_path``)."""
    _PATH_OF[0] = path_of


def module_name(module) -> str:
    """How errors name ``module``: its path in the model ``extend`` was called on (its type's
    name for a module ``extend`` did not reach)."""
    return _PATH_OF[0](module)


def _module_prefix(module) -> str:
    path = module_name(module)
    return f"curvopt cannot compute this for module {path!r} ({type(module).__name__})"


def reduction_none_error(loss_name: str) -> UnsupportedLossError:
    """The error of a loss with ``reduction="none"``, wherever curvopt meets it."""
    return UnsupportedLossError(
        f"{loss_name}(reduction='none') returns per-sample losses, which have no single scale "
        "or Hessian. Use reduction='mean' or reduction='sum'; see docs/support.md#losses."
    )


class AccumulationError(CurvoptError, RuntimeError):
    """Results of several backward passes in one ``collect`` that do not combine."""
