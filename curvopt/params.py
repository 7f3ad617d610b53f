"""Which parameters each extended module is responsible for (looked up at backward time)."""

from __future__ import annotations

import weakref
from typing import Dict, List, Set, Tuple

from torch import nn

#: every module with parameters that ``extend`` hooked
EXTENDED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def owned_parameters(module: nn.Module, owns_children: bool) -> Dict[str, nn.Parameter]:
    """The parameters a rule is responsible for, by (dotted) name."""
    if owns_children:
        return dict(module.named_parameters())
    return dict(module.named_parameters(recurse=False))


def owned(module: nn.Module) -> List[Tuple[str, nn.Parameter]]:
    """``(name, parameter)`` pairs the module's rule handles, looked up now (not at extend)."""
    if module._curvopt_owns_children:
        return list(module.named_parameters())
    return [(name, p) for name, p in module._parameters.items() if p is not None]


def trainable(module: nn.Module) -> List[Tuple[str, nn.Parameter]]:
    return [(name, p) for name, p in owned(module) if p.requires_grad]


def shared_parameters() -> Set[int]:
    """ids of parameters owned by more than one extended module (weight tying)."""
    seen, shared = set(), set()
    for module in list(EXTENDED):
        for _, p in owned(module):
            (shared if id(p) in seen else seen).add(id(p))
    return shared
