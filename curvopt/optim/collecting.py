"""What a curvature optimizer collects, and when (:class:`Collecting`, a base of
``CurvatureOptimizer``): the armed collection of ``collection="auto"`` and ``opt.collect()``.

The extensions a step needs come from the optimizer's ``_needs(group, group_state)``, per param
group, scoped to the group's parameters (``_requests``); the optimizer provides
``param_groups``, ``_group_state`` and ``_distributed``.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Any, Callable

import torch

from curvopt import extensions
from curvopt.frontend.collect import collect
from curvopt.frontend.collection import Collection

#: an extension to collect: ``(attr, options)`` for ``curvopt.extensions.extension``
ExtensionSpec = tuple[str, dict[str, Any]]

#: the start of the warning ``curvopt.collect(skip_unsupported=...)`` gives at every pass
_SKIP_WARNING = r"curvopt\.collect\(skip_unsupported=True\) wrote no Kronecker factors"


class Collecting:
    """Collecting for ``CurvatureOptimizer`` (see :mod:`curvopt.optim.collecting`)."""

    # ----------------------------------------------------------------- the armed collection
    # ``collection="auto"`` (default): the optimizer owns a
    # ``curvopt.frontend.collection.Collection``, armed from construction, that collects
    # ``_requests()`` on every backward pass reaching its parameters; the window it combines ends at
    # ``step()`` and ``zero_grad()``.
    # ``"explicit"`` (and under ``torch.distributed``): only ``opt.collect()`` and
    # ``opt.step(closure)`` collect, as ``curvopt.collect`` blocks.
    def _arm(self, mode: str) -> None:
        if mode not in ("auto", "explicit"):
            raise ValueError(f"collection must be 'auto' or 'explicit', got {mode!r}")
        self._collection_mode = mode
        self._collection = Collection(_weak(self._armed_requests))
        if mode == "auto" and self._distributed is None:
            self._collection.arm()
        if any(group.get("curvature_samples") for group in self.param_groups):
            self._requests()  # an extension without sub-batches raises now, not in a backward

    def _armed_requests(self) -> tuple[list, list[tuple[torch.Tensor, str]], dict[str, Any]]:
        return (*self._requests(), self._collect_options())

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As in ``torch.optim``; the armed collection starts a new window too."""
        super().zero_grad(set_to_none)
        self._collection.reset()

    # ----------------------------------------------------------------- collecting
    def _needs(self, group: dict[str, Any], group_state: dict[str, Any]) -> list[ExtensionSpec]:
        """The extensions ``group`` needs for its next step."""
        raise NotImplementedError

    def _requests(self) -> tuple[list, list[tuple[torch.Tensor, str]]]:
        """The extensions the next step needs, and the ``(param, attr)`` pairs they write."""
        made: dict[str, extensions.Extension] = {}
        users: list[tuple[dict[str, Any], str]] = []
        for group, group_state in zip(self.param_groups, self._group_state):
            for attr, options in self._needs(group, group_state):
                if group.get("curvature_samples") is not None:
                    options = {**options, "samples": group["curvature_samples"]}
                wanted = extensions.extension(attr, **options)
                if made.setdefault(attr, wanted).key() != wanted.key():
                    raise ValueError(
                        f"param groups need {made[attr]} and {wanted}, with different options; "
                        "use the same options in all groups"
                    )
                users.append((group, attr))
        targets = [(p, attr) for group, attr in users for p in group["params"] if p.requires_grad]
        return list(made.values()), targets

    def collect(self):
        """``curvopt.collect(...)`` with the extensions the next ``step()`` needs.

        A null context when the next step needs none (e.g. between curvature updates). Under
        ``torch.distributed`` the collected quantities are then averaged over the ranks. With
        the collection armed (the default) a block that adds nothing: the optimizer collects
        on every backward pass anyway.
        """
        exts, targets = self._requests()
        if not exts:
            return contextlib.nullcontext()
        if self._collection.armed:  # it collects without a block: one that adds nothing
            self._collection.window()
            return QuietBlock(self._collection)
        context = collect(*exts, **self._collect_options())
        self._block = context  # its parameters without factors (``skipped``), until the step
        if self._distributed is None:
            return QuietBlock(context)
        sampled = any(getattr(ext, "source", None) == "mc" for ext in exts)
        return self._distributed.collecting(context, targets, sampled)

    def _collect_options(self) -> dict[str, Any]:
        """Keyword options of the ``curvopt.collect`` that :meth:`collect` opens."""
        return {}

    def _skipped(self) -> set[str]:
        """The names of the parameters the passes since the last step left without Kronecker
        factors (``collect(skip_unsupported=...)``): the armed collection's and those of
        the block :meth:`collect` opened."""
        block = self.__dict__.get("_block")
        return set(self._collection.skipped) | set(getattr(block, "skipped", None) or ())


def _weak(method: Callable[[], Any]) -> Callable[[], Any]:
    """``method()`` through a weak reference (None once its object is gone), so that the
    armed collection does not keep its optimizer alive."""
    ref = weakref.WeakMethod(method)

    def call():
        bound = ref()
        return None if bound is None else bound()

    return call


def skip_options(param_groups, diagonal: bool) -> dict[str, Any]:
    """The ``curvopt.collect`` options for the groups' ``fallback`` (``optim.fallback``): skip
    the parameters without Kronecker factors where a group has one; with ``diagonal``
    (``KFAC``: the engine writes their diagonal) ``"diagonal"`` where a group asks for it."""
    fallbacks = {g["fallback"] for g in param_groups}
    if diagonal and "diagonal" in fallbacks:
        return {"skip_unsupported": "diagonal"}
    return {"skip_unsupported": fallbacks != {None}}


@contextlib.contextmanager
def quiet_skips():
    """A block in which the collection's warning about skipped parameters is silenced (the
    optimizer announces them once instead, ``optim.fallback.announce``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SKIP_WARNING)
        yield


class QuietBlock:
    """``context`` (a ``curvopt.collect`` block or an armed collection) whose exit does not
    warn about skipped parameters (:func:`quiet_skips`); its attributes are ``context``'s."""

    def __init__(self, context):
        self._context = context

    def __getattr__(self, name):
        return getattr(self._context, name)

    def __enter__(self):
        self._context.__enter__()
        return self._context

    def __exit__(self, *exc):
        if not self._context.skipped:
            return self._context.__exit__(*exc)
        with quiet_skips():
            return self._context.__exit__(*exc)
