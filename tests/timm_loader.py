"""timm for the tests, or a skip: ``timm_or_skip()``.

timm (a test dependency, the ``reference`` extra) imports torchvision at import time, for names
its models never call (``FrozenBatchNorm2d`` in isinstance checks, the data pipeline's
transforms and datasets). torchvision's wheels on PyPI are built against a CUDA torch and do not
load beside the CPU torch the project installs, so where ``import torchvision`` fails the tests
give timm a stand-in: an importable ``torchvision`` package whose every name is an empty class.
Nothing the tests run reaches it (a model that called torchvision would fail loudly on the empty
class). The stand-in lives only in the test process; curvopt never imports timm or torchvision.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

import pytest


class _Absent(type):
    """An empty class; any attribute of it is another one (``InterpolationMode.BILINEAR``)."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Absent(name, (), {})


class _AbsentTorchvision(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``torchvision`` and each of its submodules as an empty package."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []

        def __getattr__(name):
            if name.startswith("__"):
                raise AttributeError(name)
            return _Absent(name, (), {})

        module.__getattr__ = __getattr__
        return module

    def exec_module(self, module):
        pass


def _torchvision_loads() -> bool:
    if importlib.util.find_spec("torchvision") is None:
        return False
    try:
        importlib.import_module("torchvision")
    except Exception:  # noqa: BLE001 - a CUDA build beside a CPU torch fails in many ways
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        return False
    return True


def timm_or_skip():
    """The ``timm`` module (with the torchvision stand-in where torchvision does not load), or
    skip the test where timm is not installed."""
    if importlib.util.find_spec("timm") is None:
        pytest.skip("timm is not installed (the reference extra: make reference)")
    if "timm" not in sys.modules and not _torchvision_loads():
        if not any(isinstance(f, _AbsentTorchvision) for f in sys.meta_path):
            sys.meta_path.insert(0, _AbsentTorchvision())
    return importlib.import_module("timm")
