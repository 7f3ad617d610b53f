"""The public API's docstrings: each has a summary line, ``Args:`` and an example, and the
``>>>`` examples run and print what they show.

The public objects are the names in ``__all__`` of ``curvopt``, ``curvopt.extensions``,
``curvopt.optim``, ``curvopt.linalg`` and ``curvopt.laplace`` (modules in ``curvopt.__all__``
are namespaces, checked through their own ``__all__``). Examples written as ``Example::``
literal blocks (those that need data or an optional package, e.g. laplace) are not run.
"""

from __future__ import annotations

import doctest
import enum
import importlib
import inspect
import time

import pytest

PACKAGES = ["curvopt", "curvopt.extensions", "curvopt.optim", "curvopt.linalg"]

#: extensions whose constructor takes no arguments: their docstring says so instead of ``Args:``
NO_ARGUMENTS = {
    "BatchGrad",
    "BatchL2Grad",
    "SumGradSquared",
    "Variance",
    "DiagGGNExact",
    "BatchDiagGGNExact",
    "DiagHessian",
    "BatchDiagHessian",
    "KFRA",
}


#: a single ``>>>`` example may take this long (they are meant to run in about a second)
EXAMPLE_SECONDS = 5.0


def _public(package: str) -> list[tuple[str, object]]:
    module = importlib.import_module(package)
    names = getattr(module, "__all__", None)
    assert names is not None, f"{package} declares no __all__"
    objects = [(f"{package}.{n}", getattr(module, n)) for n in names]
    return [(n, o) for n, o in objects if not inspect.ismodule(o)]


def _laplace() -> list[tuple[str, object]]:
    try:
        return _public("curvopt.laplace")
    except ImportError:  # laplace-torch is optional
        return []


PUBLIC = [item for package in PACKAGES for item in _public(package)] + _laplace()


def _docstring(obj) -> str:
    """The object's docstring; for a class also its own ``__init__``'s."""
    doc = inspect.getdoc(obj) or ""
    if inspect.isclass(obj) and "__init__" in obj.__dict__:
        doc += "\n" + (inspect.getdoc(obj.__init__) or "")
    return doc


def _case(name: str, obj):
    return pytest.param(name, obj, id=name)


def test_public_list_is_complete():
    names = {name for name, _ in PUBLIC}
    for expected in (
        "curvopt.extend",
        "curvopt.collect",
        "curvopt.verify",
        "curvopt.extensions.BatchGrad",
        "curvopt.extensions.EKFAC",
        "curvopt.optim.KFAC",
        "curvopt.optim.VarianceAdaptedSGD",
        "curvopt.optim.LevenbergMarquardt",
        "curvopt.linalg.GGN",
        "curvopt.linalg.top_eigenpairs",
    ):
        assert expected in names


@pytest.mark.parametrize("name, obj", [_case(n, o) for n, o in PUBLIC])
def test_docstring_has_summary_args_and_example(name, obj):
    doc = _docstring(obj)
    assert doc.strip(), f"{name} has no docstring"
    summary = doc.strip().splitlines()[0]
    assert summary.strip(), f"{name}: the docstring starts without a summary line"
    assert "Example" in doc or ">>>" in doc, f"{name}: no example (Example: or >>>)"
    short = name.rsplit(".", 1)[1]
    if inspect.isclass(obj) and issubclass(obj, enum.Enum):
        assert "Attributes:" in doc, f"{name}: an enum lists its members under Attributes:"
    elif short in NO_ARGUMENTS and name.startswith("curvopt.extensions."):
        assert "Takes no arguments" in doc, f"{name}: say that it takes no arguments"
        obj()  # and it does construct without them
    else:
        assert "Args:" in doc, f"{name}: no Args: section"


def _examples():
    finder = doctest.DocTestFinder(recurse=False)
    cases = []
    for name, obj in PUBLIC:
        targets = [obj]
        if inspect.isclass(obj) and "__init__" in obj.__dict__:
            targets.append(obj.__init__)
        tests = [t for target in targets for t in finder.find(target, name) if t.examples]
        if tests:
            cases.append(pytest.param(tests, id=name))
    return cases


EXAMPLES = _examples()


def test_examples_exist_for_the_simple_objects():
    """The quantities, optimizers and operators have run examples, not only literal blocks."""
    run = {param.id for param in EXAMPLES}
    for name in (
        "curvopt.extensions.BatchGrad",
        "curvopt.extensions.KFAC",
        "curvopt.extensions.EKFAC",
        "curvopt.optim.KFAC",
        "curvopt.optim.DiagGGNNewton",
        "curvopt.linalg.GGN",
        "curvopt.linalg.KFAC",
    ):
        assert name in run, f"{name} has no >>> example"


@pytest.mark.parametrize("tests", EXAMPLES)
def test_examples_run(tests):
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    runner = doctest.DocTestRunner(optionflags=flags)
    for test in tests:
        # as ``doctest.testmod``: the globals of the module defining the object (a copy)
        start = time.perf_counter()
        runner.run(test)
        seconds = time.perf_counter() - start
        assert seconds < EXAMPLE_SECONDS, f"{test.name}: the example took {seconds:.1f} s"
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{tests[0].name}: {result.failed} example(s) failed (see above)"
