"""``extend``: forward hooks that leave, on each output's autograd node, what backward needs;
``unextend``: the same hooks taken off again.

Outside ``collect`` a hook only keeps references to inputs that autograd already saved for
the weight gradient, and drops them as soon as the gradient passes the module; nothing is
computed. Hooks are installed on every module that owns parameters (and on losses); while the
optimizers' armed collections covering a model rest (a plain step, which refreshes no
curvature) and no block is open, the model's hooks are taken off (``resting``), so a hook
that runs has work to do.

Nothing is written onto the user's modules or parameters: what ``extend`` installed (paths,
options, hook handles) is kept in ``curvopt.core.extended``, weakly, and ``unextend`` removes
the hooks through their handles. A copy of an extended module (``copy.deepcopy``, pickling)
carries copies of the hooks but no entry: they do nothing (the copy is a plain module), and
``extend`` or ``unextend`` of the copy removes them (:func:`_drop_copied`); a copy of a
resting model carries none.

A ``torch.compile``d model (``OptimizedModule``) runs its compiled graph, whose backward is one
fused op: first-order quantities come out of it as from the eager model, curvature cannot
pass through it (``graph.walk``). ``extend`` of the compiled model therefore makes its forward
run the original module eagerly while a second-order collection is open or armed for its
parameters (``functional.wants_loss``: a curvature optimizer's every step), and compiled
otherwise (:func:`_eager_for_curvature`); ``unextend`` restores its forward.
"""

from __future__ import annotations

import functools
import weakref
from typing import Optional

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook

from curvopt.loop.routing import module_hook, parameter_hook
from curvopt.layers import rule_for
from curvopt.core.extended import ModuleEntry, drop, entry_for, entry_of, is_extended
from curvopt.core.extended import module_entry
from curvopt.core.params import forget, holders, note_extended, owned_parameters, owned_tensors
from curvopt.entry.recognize import returned_loss, watch
from curvopt.entry.functional import hook_loss, wants_loss, watch_outputs
from curvopt.core.records import (
    Record,
    anchor,
    note_random_state,
    take_random_state,
)
from curvopt.core.calls import output_tensors
from curvopt.core.state import STATE, SUSPENDED
from curvopt.autograd.torch_internals import current_graph_task_id, drop_empty_tensor_hooks
from curvopt.autograd.torch_internals import hook_gradient

__all__ = ["extend", "unextend", "is_extended", "Record"]


def _random_state_hook(module, args, kwargs):
    """Before the forward of a module whose rule re-runs it: the generator state it draws from,
    where it draws (``LayerRule.draws_random``)."""
    if SUSPENDED.get() or not torch.is_grad_enabled():
        return
    if not rule_for(module).draws_random(module):
        return
    first = next((x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)), None)
    if first is not None:
        note_random_state(module, first.device)


def _module_forward_hook(entry: ModuleEntry, module, args, kwargs, output):
    """After a forward of an extended module (``entry``: its entry, bound at ``extend``; a hook
    copied with the module onto a copy, whose entry is not this one, does nothing)."""
    random = take_random_state(module) if entry.notes_random else None  # (else none noted)
    if SUSPENDED.get() or not torch.is_grad_enabled() or module_entry(module) is not entry:
        return
    # (a loop: a generator costs a call a step)
    for p in owned_tensors(module, entry.owns_children):
        if p is not None and p.requires_grad:
            break
    else:
        return
    if entry.unhooked:
        _hook_unfrozen(entry)
    outputs = [t for t in output_tensors(output) if t.requires_grad]
    if not outputs:
        return
    rule = rule_for(module)
    anchors = [anchor(outputs[0], (*args, *kwargs.values()))] if len(outputs) == 1 else outputs
    record = Record(
        module,
        args,
        kwargs,
        outputs,
        rule.batch_dim(module),
        rule.positionwise,
        anchors,
        random,
        entry,
        _outer_task(),
    )
    if rule.positionwise and entry.sequence_first and outputs[0].dim() >= 3:
        record.transposed = True  # declared: extend(model, sequence_first=True)
    for tap in entry.taps:
        tap.called(record)
    if len(anchors) == 1:
        hook_gradient(anchors[0], module_hook(record))
    else:
        register_multi_grad_hook(anchors, module_hook(record, several=True), mode="all")


def _hook_unfrozen(entry: ModuleEntry) -> None:
    """Give the gradient hook to each parameter of ``entry``'s module that was frozen when
    ``extend`` ran and requires grad now (unfrozen for fine-tuning), before this call's
    backward: its gradient is then checked like every other extended parameter's. One still
    frozen costs a look at ``requires_grad`` per call (a LoRA layer's base weight)."""
    frozen = []
    for ref in entry.unhooked:
        p = ref()
        if p is None:
            continue
        if not p.requires_grad:
            frozen.append(ref)
            continue
        parameter = entry_of(p)
        if parameter is not None and parameter.handle is None:
            parameter.handle = p.register_hook(parameter_hook(p))
    entry.unhooked = frozen


def _outer_task():
    """The backward pass that runs this forward, while a collection is active: a reentrant
    checkpoint recomputing its segment inside a pass (``Record.outer``); None otherwise."""
    if STATE.collecting is None:
        return None
    task = current_graph_task_id()
    return None if task < 0 else task


def _loss_forward_hook(module, args, kwargs, output):
    if SUSPENDED.get() or not torch.is_grad_enabled() or not output.requires_grad:
        return
    entry = module_entry(module)
    if entry is not None and entry.hooks:  # not a copy of an extended loss
        hook_loss(module, args, kwargs, output)


def _returned_loss_hook(module, args, kwargs, output):
    """While a collection is open or armed: a loss the model computed itself (Hugging Face's
    ``labels=``) read from the graph (``recognize``), and, where the collection needs the loss,
    the other outputs watched for a loss computed from them after the forward
    (``functional``)."""
    if SUSPENDED.get() or STATE.collecting is None or not torch.is_grad_enabled():
        return
    loss = returned_loss(output)
    if loss is not None:
        watch(loss)
    if wants_loss(module):
        watch_outputs(output, loss)


#: the hooks ``extend`` registers on modules, by which copied ones are recognised
_HOOKS = (_random_state_hook, _module_forward_hook, _loss_forward_hook, _returned_loss_hook)


def _drop_copied(module: nn.Module) -> None:
    """Remove from ``module`` the hooks of curvopt it carries but did not get from ``extend``:
    those copied with it from an extended module (``copy.deepcopy``, pickling)."""
    entry = entry_of(module)
    own = set() if entry is None else {h.id for h in (*entry.hooks, entry.watcher) if h}
    for hooks, extra in (
        (
            module._forward_hooks,
            (module._forward_hooks_with_kwargs, module._forward_hooks_always_called),
        ),
        (module._forward_pre_hooks, (module._forward_pre_hooks_with_kwargs,)),
    ):
        for key, hook in list(hooks.items()):
            if key not in own and getattr(hook, "func", hook) in _HOOKS:
                del hooks[key]
                for d in extra:
                    d.pop(key, None)


def _hook(module: nn.Module, path: str, fn, before=None) -> None:
    """Hook ``module``'s forward with ``fn`` (and ``before`` its forward) unless hooked; its
    path is ``path`` from now on."""
    entry = entry_for(module)
    entry.path = path or type(module).__name__
    if entry.hooks:
        return
    _drop_copied(module)
    if before is not None:
        entry.hooks.append(module.register_forward_pre_hook(before, with_kwargs=True))
        entry.notes_random = True
    entry.hooks.append(module.register_forward_hook(fn, with_kwargs=True))


def _install(module: nn.Module, path: str, sequence_first: bool, model: nn.Module) -> None:
    """Hook ``module`` and its submodules, parts of ``model`` (the module ``extend`` was
    called on)."""
    _drop_copied(module)
    rule = rule_for(module)
    params = owned_parameters(module, rule.owns_children)
    unhooked = []
    for name, p in params.items():
        entry = entry_for(p)
        if p.requires_grad and entry.handle is None:
            entry.handle = p.register_hook(parameter_hook(p))
        if entry.handle is None:
            unhooked.append(weakref.ref(p))
        if entry.path is None:
            entry.path = f"{path}.{name}" if path else name
    if params:
        entry = entry_for(module)
        entry.unhooked = unhooked
        entry.owns_children = rule.owns_children
        entry.sequence_first = entry.sequence_first or sequence_first
        note_extended(module, model)
        before = _random_state_hook if rule.replays_random_forward else None
        _hook(module, path, functools.partial(_module_forward_hook, entry), before)
    if rule.owns_children:
        return
    for name, child in module.named_children():
        _install(child, f"{path}.{name}" if path else name, sequence_first, model)


def extend(
    module: nn.Module, name: Optional[str] = None, sequence_first: bool = False
) -> nn.Module:
    """Install curvopt's hooks on ``module`` (a model, any submodule, or a loss) and return it.

    Idempotent. An extended model computes exactly what the plain model computes; the hooks only
    act inside :func:`curvopt.collect`. Nothing is set on ``module`` or its parameters besides
    the hooks, and :func:`unextend` removes those. A copy of an extended model
    (``copy.deepcopy``, pickling) is not extended: extend the copy.

    ``sequence_first=True`` declares that the positionwise layers (``Linear``, ``Embedding``,
    norms) see ``[T, N, ...]``: their batch is dim 1. curvopt finds that by itself where a layer
    with a fixed batch dim (``MultiheadAttention(batch_first=False)``, a convolution) or a
    broadcast position embedding anchors the batch; a model made of positionwise layers only
    has nothing to tell ``[T, N]`` from ``[N, T]``, and is read batch-first unless declared.

    Args:
        module: a model, any submodule, or a loss module.
        name: the path the error messages give the module (default: its attribute path).
        sequence_first: the position-wise layers see ``[T, N, ...]``.

    Returns:
        ``module`` itself, hooked.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.

    Example::

        model = curvopt.extend(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)))
        lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"curvopt.extend expects a torch.nn.Module, got {type(module).__name__}")
    if isinstance(module, nn.modules.loss._Loss):
        _hook(module, name or "", _loss_forward_hook)
        return module
    reached = is_extended(module)  # hooked as a part of a model extended before
    _install(module, name or "", sequence_first, module)
    if _compiled(module):
        _eager_for_curvature(module)
    entry = entry_of(module)
    if not (reached or (entry is not None and entry.watcher is not None)):
        entry = entry_for(module)
        _drop_copied(module)
        entry.watcher = module.register_forward_hook(_returned_loss_hook, with_kwargs=True)
    return module


def _compiled(module: nn.Module) -> bool:
    """Whether ``module`` is a ``torch.compile`` wrapper (``OptimizedModule``; duck-typed, so
    that curvopt does not import dynamo)."""
    return type(module).__name__ == "OptimizedModule" and "_orig_mod" in module._modules


def _eager_for_curvature(wrapper: nn.Module) -> None:
    """Make the compiled ``wrapper``'s forward call its original module eagerly where a
    second-order quantity is wanted of it (:func:`wants_loss`), its compiled forward otherwise;
    the compiled one is kept as the new forward's ``compiled`` (for :func:`unextend`)."""
    compiled = wrapper.forward
    if getattr(compiled, "compiled", None) is not None:
        return
    original = wrapper._orig_mod

    def forward(*args, **kwargs):
        if wants_loss(wrapper):
            return original(*args, **kwargs)
        return compiled(*args, **kwargs)

    forward.compiled = compiled
    wrapper.forward = forward


def unextend(module: nn.Module) -> nn.Module:
    """Remove every hook :func:`extend` installed on ``module`` and return it.

    Takes the hooks off ``module`` (a model, any submodule, or a loss), off all its submodules
    (those extended on their own too) and off their parameters, and forgets them: the model is
    again the plain model, as if never extended, and ``extend`` may hook it again. A parameter
    that a module outside ``module`` still holds as extended (a weight tied to a module that is
    not unextended) keeps its hook. Calls made before ``unextend`` whose gradients have not
    arrived yet keep what their forward left. A module that is not extended is returned as it
    is (but for the inert hooks a copy of an extended module carries, which go too).

    Args:
        module: a model, any submodule, or a loss module that :func:`extend` hooked.

    Returns:
        ``module`` itself, without curvopt's hooks.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.

    Example::

        model = curvopt.extend(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)))
        ...  # collect per-sample gradients, train with curvopt.optim
        model = curvopt.unextend(model)  # a plain model again: no hook left on it
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"curvopt.unextend expects a torch.nn.Module, got {type(module).__name__}")
    compiled = getattr(vars(module).get("forward"), "compiled", None)
    if _compiled(module) and compiled is not None:
        module.forward = compiled
    modules = list(module.modules())
    for sub in modules:
        entry = drop(sub)
        for handle in () if entry is None else (*entry.hooks, entry.watcher):
            if handle is not None:
                handle.remove()
        _drop_copied(sub)
    forget(modules)
    for p in module.parameters():
        if holders([p]):
            continue  # held by an extended module outside ``module`` (tied weights)
        entry = drop(p)
        if entry is not None and entry.handle is not None:
            entry.handle.remove()
            drop_empty_tensor_hooks(p)
    return module
