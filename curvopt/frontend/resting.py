"""Hooks that have nothing to do are not installed: taken off a resting model, put back where
they were as soon as one of them may act.

A collection that rests (``Collection.follow``: its owner's next step collects nothing) takes
no pass, so the modules it covers need no record. Their hooks returning at once would still
cost: torch calls a module without hooks on its fast path, and a hooked parameter calls into
Python in every backward. So :func:`settle` (run by ``collect.refresh`` at every change of the
collections' arming) takes the hooks of such modules out of torch's hook dicts, the parameters'
tensor hooks too, and puts them back when they may act again: forward and backward of a
resting model cost what the plain model's cost.

What rests is decided per model (the module ``extend`` was called on). A collection covers the
models holding the parameters of its last window that named any (``Collection.covers``); one
that has not collected yet, or whose owner's parameters may have changed since
(``add_param_group``, a loaded state), covers every model. A module's hooks are off while

* no ``collect`` block is open (it may read any extended module) and no explicit collection
  waits for a step that collects (``STATE.explicit``: it needs the records of the forward
  before its block),
* no awake armed collection covers one of its models, and
* a resting one covers one of them: a model that no optimizer's collection covers keeps its
  hooks, for a ``collect`` block around a backward after the forward.

A parameter's tensor hook is off while the hooks of every module holding it are (tied weights,
a module shared by two models). An extended loss belongs to no model: its hook is off while
every armed collection rests (``STATE.plain``).

A hook goes back after the hook that came before it when it was taken off (the first still
there), so its order among the user's hooks is the one it would have had, never taken off:
before those registered after ``extend``, after those registered before, whether they were
registered while it rested or not (``prepend=True`` ones: in front). ``unextend`` drops the
entries, so what was taken off stays off; a copy of a resting model (``copy.deepcopy``,
pickling) carries no hook of curvopt at all.
"""

from __future__ import annotations

from typing import Optional

from curvopt.autograd.torch_internals import put_back, put_back_tensor_hook, take_off
from curvopt.autograd.torch_internals import take_off_tensor_hook
from curvopt.core.extended import module_entries, parameter_entries
from curvopt.core.state import STATE


def _resting_models() -> Optional[tuple]:
    """``(awake, resting, all_resting)``: the ids of the models an awake armed collection
    covers, of those a resting one covers, and whether a resting one covers every model (it
    has not collected yet); None where every hook may act (a block open, an explicit
    collection waiting, nothing armed, an awake collection covering every model)."""
    if STATE.open is not None or not STATE.armed:
        return None
    for ref in STATE.explicit:
        watched = ref()
        if watched is not None and not watched.resting:
            return None
    awake, resting, all_resting = set(), set(), False
    for ref in STATE.armed:
        armed = ref()
        if armed is None:
            continue
        models = armed.covers()
        if models is None and not armed.resting:
            return None
        if models is None:
            all_resting = True
        else:
            (resting if armed.resting else awake).update(models)
    return awake, resting, all_resting


def settle() -> None:
    """Take off the hooks that have nothing to do now, and put back those that may act."""
    found = _resting_models()
    if found is None and not STATE.taken:
        return
    awake, resting, all_resting = found if found is not None else (set(), set(), False)
    off = {}  # id(module) -> whether its hooks are off
    for module, entry in module_entries():
        if not entry.hooks and entry.watcher is None:
            continue  # a path only (``extended.set_path``)
        models = {id(m) for m in (ref() for ref in entry.models) if m is not None}
        if entry.watcher is not None:
            models.add(id(module))  # a model's own watcher
        if found is None:
            rests = False
        elif not models:  # an extended loss
            rests = STATE.plain
        else:
            rests = not (models & awake) and (all_resting or bool(models & resting))
        off[id(module)] = rests
        if rests and entry.taken is None:
            handles = (*entry.hooks, entry.watcher)
            entry.taken = [(h, take_off(h)) for h in handles if h is not None]
        elif not rests and entry.taken is not None:
            for handle, taken in entry.taken:
                hooks = handle.hooks_dict_ref()
                if taken is not None and hooks is not None:
                    put_back(hooks, taken)
            entry.taken = None
    for p, entry in parameter_entries():
        if entry.handle is None:
            continue
        holders = [off.get(id(m)) for m in (ref() for ref in entry.holders) if m is not None]
        holders = [rests for rests in holders if rests is not None]
        rests = bool(holders) and all(holders)
        if rests and entry.taken is None:
            entry.taken = take_off_tensor_hook(p, entry.handle)
        elif not rests and entry.taken is not None:
            entry.handle = put_back_tensor_hook(p, entry.taken)
            entry.taken = None
    STATE.taken = found is not None and any(off.values())
