"""Which parameters each extended module is responsible for (looked up at backward time).

A parameter held by a module *and* by one of its descendants (BERT's masked-LM head owns a
raw ``bias`` that is also ``decoder.bias``) belongs to the deepest holder: the parent's forward
reaches it through the child's call, so the child's rule accounts for it. Should the parent
also use it directly, the per-sample sums miss that use and the backward pass raises.

The modules of a parameter come from the parameter itself: ``extend`` notes, weakly, every
module it finds holding it (``note_extended``, in the parameter's entry of ``extended``, the
registry of what ``extend`` installed), and ``owners``/``tied`` ask those that still own it,
never every extended model in the process (weights tied after ``extend`` are seen once
``extend`` runs again); ``unextend`` takes a module off them (``forget``). Whether a module's
rule owns its children's parameters is read from ``extended`` too.

The parameters of a model are those of its extended modules (``model_parameters``): the ones
a backward pass through the model writes for, or, where the pass does not reach them, leaves
no earlier value on (``guards.participation``). ``extend`` notes, weakly, the model each module
was extended as a part of.
"""

from __future__ import annotations

import weakref
from typing import Dict, List, Optional, Set, Tuple

from torch import nn

from curvopt.core.extended import entry_for, module_entry, owns_children, parameter_entry


#: :func:`trainable`'s default: ``entry`` not read by the caller
_LOOK_UP = object()


def _held_below(module: nn.Module) -> Set[int]:
    """ids of the parameters held by ``module``'s descendants (empty for a leaf module)."""
    return {
        id(p)
        for child in module.children()
        for sub in child.modules()
        for p in sub._parameters.values()
        if p is not None
    }


def _direct(module: nn.Module) -> List[Tuple[str, nn.Parameter]]:
    """The parameters ``module`` holds itself and no descendant holds too."""
    own = [(name, p) for name, p in module._parameters.items() if p is not None]
    if not own or not module._modules or next(module.children(), None) is None:  # a leaf
        return own
    below = _held_below(module)
    return [(name, p) for name, p in own if id(p) not in below]


def owned_parameters(module: nn.Module, owns_children: bool) -> Dict[str, nn.Parameter]:
    """The parameters a rule is responsible for, by (dotted) name."""
    if owns_children:
        return dict(module.named_parameters())
    return dict(_direct(module))


def owned(module: nn.Module, whole: Optional[bool] = None) -> List[Tuple[str, nn.Parameter]]:
    """``(name, parameter)`` pairs the module's rule handles, looked up now (not at extend);
    ``whole``: whether the rule owns the children's parameters too (default: as ``extend``
    found it)."""
    if owns_children(module) if whole is None else whole:
        return list(module.named_parameters())
    return _direct(module)


def owned_tensors(module: nn.Module, whole: bool):
    """The parameters of :func:`owned` (``whole``: as the caller read it), without their names:
    for a module without children whose rule owns none (the usual case, read at every forward
    and at the end of every pass), its ``_parameters``' values themselves, ``None`` included
    (a parameter set to None: the caller skips it)."""
    if not whole and not module._modules:
        return module._parameters.values()
    return [p for _, p in owned(module, whole)]


def trainable(module: nn.Module, entry=_LOOK_UP) -> List[Tuple[str, nn.Parameter]]:
    """The ``(name, parameter)`` of :func:`owned` that require grad, looked up now (``entry``:
    ``module``'s entry in ``extended``, or None, where the caller read it already). A module
    without children whose rule owns none (the usual case: read at every module call of a
    pass) is read straight from its ``_parameters``, what :func:`owned` returns for it."""
    if entry is _LOOK_UP:
        entry = module_entry(module)
    whole = entry is not None and entry.owns_children
    if not module._modules and not whole:
        return [(n, p) for n, p in module._parameters.items() if p is not None and p.requires_grad]
    return [(name, p) for name, p in owned(module, whole) if p.requires_grad]


def note_extended(module: nn.Module, model: nn.Module) -> None:
    """``extend`` hooked ``module`` as a part of ``model``: a holder of its parameters, and a
    module of ``model``."""
    models = entry_for(module).models
    if not any(ref() is model for ref in models):
        models.append(weakref.ref(model))
    for _, p in owned(module):
        holders = entry_for(p).holders
        if not any(ref() is module for ref in holders):
            holders.append(weakref.ref(module))


def model_parameters(model: nn.Module) -> List[nn.Parameter]:
    """The parameters of ``model``'s extended modules (looked up now), each once, frozen ones
    included: those a backward pass through ``model`` could write for, or leaves no earlier
    value on (``requires_grad`` switched off since).

    The modules are those of ``model.modules()``, each once, read level by level from a list
    that grows as it is read, not through ``named_modules``' nested generators (a Python call
    per module and level of nesting, at the end of every pass); their order is not
    ``modules()``' (each parameter found is one of the set, handled on its own)."""
    found: Dict[int, nn.Parameter] = {}
    modules = [model]
    seen: Set[nn.Module] = {model}
    for module in modules:  # (``modules`` grows while it is read)
        for child in module._modules.values():
            if child is not None and child not in seen:
                seen.add(child)
                modules.append(child)
        entry = module_entry(module)
        if entry is not None and entry.hooks:  # extended
            for p in owned_tensors(module, entry.owns_children):
                if p is not None:
                    found.setdefault(id(p), p)
    return list(found.values())


def forget(modules) -> None:
    """``unextend`` took the hooks off ``modules``: they hold no parameter for curvopt any
    more."""
    gone = {id(m) for m in modules}
    for p in {id(p): p for m in modules for p in m.parameters()}.values():
        holders = _holders(p)
        holders[:] = [r for r in holders if r() is not None and id(r()) not in gone]


def _holders(p) -> list:
    """The weak references to the modules ``extend`` found holding ``p`` (empty: none)."""
    entry = parameter_entry(p)
    return [] if entry is None else entry.holders


def tied(p: nn.Parameter) -> bool:
    """Whether more than one extended module owns ``p`` (weight tying), of the modules
    ``extend`` found holding it."""
    refs = _holders(p)
    if len(refs) < 2:  # (the usual case: no module to count)
        return False
    holders = (ref() for ref in refs)
    return sum(m is not None and any(q is p for _, q in owned(m)) for m in holders) > 1


def owners(params) -> Dict[int, Tuple[nn.Module, str]]:
    """``id(p) -> (module, name)`` for those of ``params`` an extended module's rule handles
    (``name`` as that module calls it): the first module ``extend`` found holding ``p`` that
    still owns it."""
    found: Dict[int, Tuple[nn.Module, str]] = {}
    for p in params:
        for ref in _holders(p):
            module = ref()
            name = None if module is None else next((n for n, q in owned(module) if q is p), None)
            if name is not None:
                found[id(p)] = (module, name)
                break
    return found


def holders(params) -> List[nn.Module]:
    """Every extended module that owns one of ``params`` (of those ``extend`` found holding
    them), each once."""
    found: Dict[int, nn.Module] = {}
    for p in params:
        for ref in _holders(p):
            module = ref()
            if module is not None and any(q is p for _, q in owned(module)):
                found.setdefault(id(module), module)
    return list(found.values())
