"""What ``extend`` installed, kept beside the user's objects and never written onto them.

``extend`` sets no attribute on a module or a parameter. Per module it hooked (a module with
parameters, a loss, or a model whose returned loss it watches) a :class:`ModuleEntry` here holds
the path the error messages give it, the models it was extended as a part of, whether its rule
owns its children's parameters, ``sequence_first``, how many of its calls await their gradients
(``live``) and the handles of the hooks it registered; per parameter a :class:`ParameterEntry`
holds its path, the handle of its tensor hook and the modules ``extend`` found holding it
(``curvopt.core.params``).
``unextend`` removes the hooks through those handles and drops the entries.

The tables are keyed weakly by identity: ``id(obj)`` with a weak reference that drops the entry
when ``obj`` is freed (a tensor's ``==`` is elementwise and a module may define its own, so
nothing is compared by ``==``). An entry holds no reference to its object (a hook handle refers
to its hook dict weakly), so an extended model is freed as a plain one is.

Objects of curvopt's own that errors name like modules (a reentrant checkpoint's segment, the
loss module made for a functional loss) get a path only (:func:`set_path`): they are not extended.
"""

from __future__ import annotations

import weakref
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from curvopt import errors


class ModuleEntry:
    """What ``extend`` keeps of a module (or loss) it hooked."""

    __slots__ = (
        "path",
        "models",
        "owns_children",
        "sequence_first",
        "live",
        "hooks",
        "watcher",
        "taps",
        "notes_random",
        "unhooked",
        "taken",
    )

    def __init__(self):
        self.path: Optional[str] = None  # the module's path in the model, for error messages
        #: weak references to the modules ``extend`` was called on that hold it (its models:
        #: ``params.model_parameters``), each once
        self.models: List[weakref.ref] = []
        self.owns_children = False  # its rule handles its children's parameters
        self.sequence_first = False  # declared: extend(model, sequence_first=True)
        self.live = 0  # its calls awaiting their gradients (``records.Record``)
        self.hooks: List = []  # handles of its forward (pre-)hooks: it is extended when any
        #: a pre-hook notes the generator state each forward draws from (``records``)
        self.notes_random = False
        #: weak references to its parameters that did not require grad when ``extend`` ran,
        #: so have no gradient hook yet: its forward hook adds one to each that requires grad now
        self.unhooked: List[weakref.ref] = []
        self.watcher = None  # handle of the hook reading the loss a model returns
        #: consumers of its calls beside the backward passes (``optim.gradient_factors``): the
        #: forward hook hands each new ``Record`` to ``tap.called(record)``, its gradient hook
        #: the output gradients to ``tap.differentiated(record, grads)``
        self.taps: List = []
        #: its hooks (``hooks`` and ``watcher``) taken off while they have nothing to do
        #: (``frontend.resting``): ``[(handle, torch_internals.TakenOff)]``; None: installed
        self.taken: Optional[list] = None

    def __getstate__(self) -> dict:
        """Copied with a copy of its module (the module's forward hook is bound to it), whose
        hooks do nothing: without the weak references (to the models, to the parameters without
        a hook), which do not pickle."""
        weak = ("models", "unhooked")
        return {name: getattr(self, name) for name in self.__slots__ if name not in weak}

    def __setstate__(self, state: dict) -> None:
        self.models, self.unhooked = [], []
        for name, value in state.items():
            setattr(self, name, value)


class ParameterEntry:
    """What ``extend`` keeps of a parameter of a module it hooked."""

    __slots__ = ("path", "handle", "holders", "taken")

    def __init__(self):
        self.path: Optional[str] = None  # its path in the model, for error messages
        self.handle = None  # its tensor hook's handle (None: it did not require grad)
        #: its tensor hook, taken off while its modules' hooks rest (``frontend.resting``)
        self.taken = None
        #: weak references to the extended modules found holding it, in order (``params``)
        self.holders: List[weakref.ref] = []


class _Table:
    """``obj -> entry``, keyed by ``id(obj)`` with a weak reference to ``obj``: the entry is
    dropped when ``obj`` is freed; a later object with the same id finds nothing."""

    def __init__(self):
        self._data: Dict[int, Tuple[weakref.ref, object]] = {}

    def get(self, obj):
        found = self._data.get(id(obj))
        return found[1] if found is not None and found[0]() is obj else None

    def add(self, obj, entry) -> None:
        key, data = id(obj), self._data

        def gone(ref, key=key) -> None:
            if key in data and data[key][0] is ref:
                del data[key]

        data[key] = (weakref.ref(obj, gone), entry)

    def pop(self, obj):
        entry = self.get(obj)
        if entry is not None:
            del self._data[id(obj)]
        return entry

    def __len__(self) -> int:
        return len(self._data)

    def items(self) -> List[tuple]:
        """``(obj, entry)`` of every live ``obj``."""
        found = []
        for ref, entry in list(self._data.values()):
            obj = ref()
            if obj is not None:
                found.append((obj, entry))
        return found


_MODULES = _Table()
_PARAMETERS = _Table()


def _table(obj) -> _Table:
    # not ``nn.Parameter``: its metaclass makes ``isinstance`` four times slower
    return _PARAMETERS if isinstance(obj, torch.Tensor) else _MODULES


def entry_of(obj):
    """The entry of ``obj`` (a module, loss or parameter), or None."""
    return _table(obj).get(obj)


#: ``module_entry(module)``: the entry of ``module`` (a module or loss), or None:
#: :func:`entry_of` for the hooks (the table's own lookup: a Python call fewer at each read)
module_entry = _MODULES.get

#: ``parameter_entry(p)``: the :class:`ParameterEntry` of the tensor ``p``, or None (the table's
#: own lookup, as :data:`module_entry`)
parameter_entry = _PARAMETERS.get


#: ``module_entries()``: ``(module, ModuleEntry)`` of every live module or loss with an entry
module_entries = _MODULES.items

#: ``parameter_entries()``: ``(tensor, ParameterEntry)`` of every live parameter with an entry
parameter_entries = _PARAMETERS.items


def entry_for(obj):
    """The entry of ``obj``, made (empty) if it has none."""
    table = _table(obj)
    entry = table.get(obj)
    if entry is None:
        entry = ParameterEntry() if table is _PARAMETERS else ModuleEntry()
        table.add(obj, entry)
    return entry


def drop(obj):
    """Remove ``obj``'s entry (returned, or None); its hooks stay: the caller removes them."""
    return _table(obj).pop(obj)


def set_path(obj, path: str) -> None:
    """Give ``obj`` the path errors name it by (curvopt's own stand-ins for a module: a
    checkpoint's segment, the loss module of a functional loss). It is not extended."""
    entry_for(obj).path = path


def path_of(obj, default: Optional[str] = None) -> Optional[str]:
    """The path ``extend`` (or :func:`set_path`) gave ``obj``, else ``default``."""
    entry = _table(obj).get(obj)
    path = None if entry is None else entry.path
    return default if path is None else path


def module_path(module) -> str:
    """The path of ``module`` in its model as error messages give it, else its type's name."""
    return path_of(module, type(module).__name__)


def is_extended(obj) -> bool:
    """Whether ``extend`` hooked ``obj``: a module (or loss) itself, or a parameter of an
    extended module (a tensor hook on it)."""
    entry = _table(obj).get(obj)
    if entry is None:
        return False
    return entry.handle is not None if isinstance(entry, ParameterEntry) else bool(entry.hooks)


def is_extended_parameter(p: torch.Tensor) -> bool:
    """:func:`is_extended` of a tensor (a leaf of the graph), read without asking its type."""
    entry = _PARAMETERS.get(p)
    return entry is not None and entry.handle is not None


def owns_children(module: nn.Module) -> bool:
    """Whether the rule ``extend`` found for ``module`` handles its children's parameters."""
    entry = _MODULES.get(module)
    return entry is not None and entry.owns_children


def models_of(module: nn.Module) -> List[nn.Module]:
    """The modules ``extend`` was called on that hold ``module`` (its models), alive."""
    entry = _MODULES.get(module)
    found = []
    for ref in () if entry is None else entry.models:
        model = ref()
        if model is not None:
            found.append(model)
    return found


def live_calls(module: nn.Module) -> int:
    """The calls of ``module`` whose inputs await their gradients."""
    entry = _MODULES.get(module)
    return 0 if entry is None else entry.live


errors.name_modules_by(module_path)
