"""Which parameters each extended module is responsible for (looked up at backward time).

A parameter held by a module *and* by one of its descendants (BERT's masked-LM head owns a
raw ``bias`` that is also ``decoder.bias``) belongs to the deepest holder: the parent's forward
reaches it through the child's call, so the child's rule accounts for it. Should the parent
also use it directly, the per-sample sums miss that use and the backward pass raises.
"""

from __future__ import annotations

import weakref
from typing import Dict, List, Set, Tuple

from torch import nn

#: every module with parameters that ``extend`` hooked
EXTENDED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


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
    if not own or next(module.children(), None) is None:
        return own
    below = _held_below(module)
    return [(name, p) for name, p in own if id(p) not in below]


def owned_parameters(module: nn.Module, owns_children: bool) -> Dict[str, nn.Parameter]:
    """The parameters a rule is responsible for, by (dotted) name."""
    if owns_children:
        return dict(module.named_parameters())
    return dict(_direct(module))


def owned(module: nn.Module) -> List[Tuple[str, nn.Parameter]]:
    """``(name, parameter)`` pairs the module's rule handles, looked up now (not at extend)."""
    if module._curvopt_owns_children:
        return list(module.named_parameters())
    return _direct(module)


def trainable(module: nn.Module) -> List[Tuple[str, nn.Parameter]]:
    return [(name, p) for name, p in owned(module) if p.requires_grad]


def shared_parameters() -> Set[int]:
    """ids of parameters owned by more than one extended module (weight tying)."""
    seen, shared = set(), set()
    for module in list(EXTENDED):
        for _, p in owned(module):
            (shared if id(p) in seen else seen).add(id(p))
    return shared


def owners(params) -> Dict[int, Tuple[nn.Module, str]]:
    """``id(p) -> (module, name)`` for those of ``params`` an extended module's rule handles
    (``name`` as that module calls it)."""
    wanted = {id(p) for p in params}
    found: Dict[int, Tuple[nn.Module, str]] = {}
    for module in list(EXTENDED):
        for name, p in owned(module):
            if id(p) in wanted:
                found.setdefault(id(p), (module, name))
    return found
