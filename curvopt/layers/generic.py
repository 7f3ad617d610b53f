"""Fallback for any module that owns parameters: ``torch.func`` over single samples.

For sample ``n`` the module is re-run functionally on ``x_n`` (a batch of one) and the
vector-Jacobian product with ``dL/dy_n`` gives ``g_n``; ``vmap`` batches this over samples.
Costs one extra forward per sample; registered rules are faster.

Inputs are split into samples along ``batch_dim`` for every tensor argument whose size there
equals ``N``; others (masks, shared tensors) are passed whole; rules for known modules name
them instead (:meth:`GenericRule.sample_inputs`). Modules with several tensor outputs get the
gradient of each (outputs that depend on other outputs are handled, see
:meth:`GenericRule._external_gradients`). A module in training mode is re-run with the dropout
masks its forward drew (``layers.random_replay``: the forward replayed on the whole batch from
the generator state it started from, each mask split into the samples'); alpha dropout and
modules ``vmap`` cannot run are rejected.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.func import functional_call, vjp, vmap
from torch.utils._pytree import tree_flatten, tree_unflatten

from curvopt.errors import UnsupportedModuleError, module_name
from curvopt.layers.random_replay import (
    DrawnMasks,
    MaskShapes,
    ReplayedMasks,
    ReplayError,
    per_sample,
)
from curvopt.layers.registry import LayerRule, register, register_fallback, subclass_note
from curvopt.core.params import owned_parameters
from curvopt.core.calls import output_tensors
from curvopt.core.reductions import squared_norms, sum_of_squares

#: elements of per-sample gradients held at once when only reduced quantities are wanted
_CHUNK_ELEMENTS = 1 << 21

_ALPHA = (nn.AlphaDropout, nn.FeatureAlphaDropout)


class GenericRule(LayerRule):
    reruns_module = True
    replays_random_forward = True

    def draws_random(self, module):
        return module.training

    def check(self, module):
        """Why ``module`` cannot be re-run sample by sample, after the reason it has no rule
        of its own where it subclasses a type with one (``registry.subclass_note``)."""
        reason = self._unrunnable(module)
        note = subclass_note(type(module))
        return f"{note}; {reason}" if reason and note else reason

    def _unrunnable(self, module):
        for sub_name, sub in module.named_modules():
            where = f" (submodule {sub_name!r})" if sub_name else ""
            if isinstance(sub, _ALPHA) and sub.training and sub.p > 0:
                return (
                    f"it contains alpha dropout in training mode{where}, which curvopt cannot "
                    "replay sample by sample. Call .eval() on it or use nn.Dropout; see "
                    "docs/support.md#dropout-and-random-numbers."
                )
            if isinstance(sub, nn.modules.batchnorm._BatchNorm) and sub.training:
                return (
                    f"it contains BatchNorm in training mode{where}, which mixes samples. "
                    "Call .eval() on it; see docs/support.md#batchnorm-in-training-mode."
                )
            if (
                isinstance(sub, nn.modules.instancenorm._InstanceNorm)
                and sub.training
                and sub.track_running_stats
            ):
                return (
                    f"it contains InstanceNorm with track_running_stats=True in training "
                    f"mode{where}, whose running statistics a re-run sample by sample would "
                    "update again. Call .eval() on it or set track_running_stats=False."
                )
        return None

    def batch_grad(self, call, name, out=None):
        if "generic" not in call.cache:
            call.cache["generic"] = self.batch_grads(call)
        result = call.cache["generic"][name]
        return result if out is None else out.copy_(result)

    # Reduced quantities: all owned parameters at once, chunk by chunk of samples split with
    # this rule's own knowledge of which inputs are batched (``Call.slice`` cannot know it).
    def batch_l2(self, call, name):
        return self._reduced(call)[name][0]

    def sum_grad_squared(self, call, name):
        return self._reduced(call)[name][1]

    def grad_sum(self, call, name):
        return self._reduced(call)[name][2]

    def _reduced(self, call) -> Dict[str, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``name -> (||g_n||^2 [N], sum_n g_n**2, sum_n g_n)`` for every owned parameter."""
        if "generic_reduced" in call.cache:
            return call.cache["generic_reduced"]
        numel = sum(
            p.numel()
            for p in owned_parameters(call.module, self.owns_children).values()
            if p.requires_grad
        )
        n = call.batch_size
        step = max(1, _CHUNK_ELEMENTS // max(1, numel))
        parts: Dict[str, list] = {}
        sums: Dict[str, list] = {}
        for start in range(0, n, step):
            chunk = self._run(call, (start, min(n, start + step)))
            for name, g in chunk.items():
                l2 = squared_norms(g)
                sq = sum_of_squares(g)
                parts.setdefault(name, []).append(l2)
                if name in sums:
                    sums[name][0].add_(sq)
                    sums[name][1].add_(g.sum(0))
                else:
                    sums[name] = [sq, g.sum(0)]
        result = {k: (torch.cat(parts[k]), sums[k][0], sums[k][1]) for k in parts}
        call.cache["generic_reduced"] = result
        return result

    def sample_inputs(self, call) -> Tuple[tuple, dict, List[Optional[int]]]:
        """``(args, kwargs, dims)``: the inputs to re-run the module on and, for each leaf of
        ``tree_flatten((args, kwargs))``, the dim that indexes samples (``None``: the leaf is
        shared by all samples). Default: tensors whose size along ``batch_dim`` is ``N``."""
        bd, n = call.batch_dim, call.batch_size
        leaves, _ = tree_flatten((call.args, call.kwargs))
        dims = [
            bd if isinstance(x, torch.Tensor) and x.dim() > bd and x.shape[bd] == n else None
            for x in leaves
        ]
        return call.args, call.kwargs, dims

    def output_dims(self, call, count: int) -> List[int]:
        """The dim indexing samples in each of the module's ``count`` tensor outputs."""
        return [call.batch_dim] * count

    def rerun(self, module, params, args, kwargs):
        """The module's output on one sample (inputs as :meth:`sample_inputs` made them)."""
        return functional_call(module, params, args, kwargs)

    def batch_grads(self, call) -> Dict[str, torch.Tensor]:
        """All owned parameters' per-sample gradients from one vmapped pass."""
        return self._run(call)

    def _run(self, call, samples=None) -> Dict[str, torch.Tensor]:
        """:meth:`_vmapped` with the output gradients of ``call`` (all samples, or a range)."""
        if "generic_grads" not in call.cache:
            grad_out = call.grad_out if isinstance(call.grad_out, tuple) else (call.grad_out,)
            if sum(g is not None for g in grad_out) > 1:
                call.cache["generic_grads"] = self._external_gradients(call, grad_out)
            else:
                call.cache["generic_grads"] = None, grad_out
        positions, grad_out = call.cache["generic_grads"]
        try:
            return self._vmapped(call, grad_out, positions, samples)
        except _OutputMismatch:  # some tensor outputs do not require grad: find which do
            positions = self._grad_positions(call, len(grad_out))
            call.cache["generic_grads"] = positions, grad_out
            return self._vmapped(call, grad_out, positions, samples)

    def _vmapped(self, call, grad_out, positions, samples=None) -> Dict[str, torch.Tensor]:
        """``vmap`` over samples of the VJP of the re-run module with the output gradients;
        ``positions[i]``: the index among the module's tensor outputs of gradient ``i``
        (``None``: the same index, checked); ``samples``: ``(start, stop)`` to restrict to."""
        module = call.module
        params = {
            k: p.detach()
            for k, p in owned_parameters(module, self.owns_children).items()
            if p.requires_grad
        }
        args, kwargs, dims = self.sample_inputs(call)
        leaves, spec = tree_flatten((args, kwargs))
        leaves = [x.detach() if isinstance(x, torch.Tensor) else x for x in leaves]
        const = [None if d is not None else x for x, d in zip(leaves, dims)]
        sample_leaves = [x for x, d in zip(leaves, dims) if d is not None]
        sample_dims = [d for d in dims if d is not None]
        masks = self._masks(call, samples)
        out_dims = self.output_dims(call, len(grad_out))
        used = [i for i, g in enumerate(grad_out) if g is not None]
        grads = [grad_out[i] for i in used]
        grad_dims = [out_dims[i] for i in used]
        if samples is not None:
            start, length = samples[0], samples[1] - samples[0]
            sample_leaves = [x.narrow(d, start, length) for x, d in zip(sample_leaves, sample_dims)]
            grads = [g.narrow(d, start, length) for g, d in zip(grads, grad_dims)]
        picked = used if positions is None else [positions[i] for i in used]

        def one_sample(sample, cotangents, sample_masks):
            it = iter(zip(sample, sample_dims))
            full = [c if d is None else _unsqueeze(*next(it)) for d, c in zip(dims, const)]
            args, kwargs = tree_unflatten(full, spec)

            def forward(p):
                with ReplayedMasks(sample_masks):
                    outs = output_tensors(self.rerun(module, p, args, kwargs))
                if positions is None and len(outs) != len(grad_out):
                    raise _OutputMismatch
                return tuple(outs[i] for i in picked)

            _, pullback = vjp(forward, params)
            return pullback(tuple(c.unsqueeze(d) for c, d in zip(cotangents, grad_dims)))[0]

        with call.quiet(), torch.enable_grad():
            try:
                return vmap(one_sample, in_dims=(sample_dims, grad_dims, 0))(
                    sample_leaves, grads, masks
                )
            except ReplayError as error:
                raise _not_replayed(module, error) from error
            except (RuntimeError, NotImplementedError, ValueError) as error:
                raise UnsupportedModuleError(
                    "curvopt cannot compute per-sample quantities for module "
                    f"{module_name(module)!r} ({type(module).__name__}): "
                    f"{subclass_note(type(module)) or 'it has no rule of its own'}, and "
                    "re-running it "
                    f"sample by sample with torch.func.vmap failed ({_first_line(error)}). "
                    "Register a rule for it with curvopt.layers.register; see "
                    "docs/support.md#modules-without-a-rule."
                ) from error

    def _masks(self, call, samples=None) -> List[torch.Tensor]:
        """The dropout multipliers ``[n, *s]`` of the call's samples (``samples``: a range of
        them), in the order the module draws them (``layers.random_replay``); none in eval
        mode."""
        if not call.module.training:
            return []
        root, index = _recorded(call)
        cache = root.cache if root.shared is None else root.shared  # one draw per forward
        if "generic_masks" not in cache:
            try:
                cache["generic_masks"] = self._drawn_masks(root)
            except ReplayError as error:
                raise _not_replayed(call.module, error) from error
        index = index if samples is None else index[samples[0] : samples[1]]
        return [m.index_select(0, index.to(m.device)) for m in cache["generic_masks"]]

    def _drawn_masks(self, root) -> List[torch.Tensor]:
        """Steps 1 and 2 of ``layers.random_replay`` for the recorded call ``root``."""
        module = root.module
        if root.random is None:
            return []  # a forward curvopt did not see: a draw in the re-run raises
        with root.quiet(), torch.no_grad(), root.random.replay(), DrawnMasks() as drawn:
            module(*root.args, **root.kwargs)
        if not drawn.masks:
            return []
        params = dict(owned_parameters(module, self.owns_children))
        args, kwargs, dims = self.sample_inputs(root)
        leaves, spec = tree_flatten((args, kwargs))
        first = [x if d is None else x.narrow(d, 0, 1) for x, d in zip(leaves, dims)]
        args, kwargs = tree_unflatten(first, spec)
        with root.quiet(), torch.no_grad(), MaskShapes() as shapes:
            self.rerun(module, params, args, kwargs)
        return per_sample(
            drawn.masks, shapes.shapes, root.batch_size, module_name(module), drawn.names
        )

    def _grad_positions(self, call, count: int, outs=None) -> List[int]:
        """Indices of the tensor outputs that required grad in the recorded call (the hooks
        receive gradients for those only)."""
        outs = self._eager_outputs(call) if outs is None else outs
        positions = [i for i, t in enumerate(outs) if t.requires_grad]
        if len(positions) != count:
            raise UnsupportedModuleError(
                f"curvopt cannot match the {count} output gradients of module "
                f"{module_name(call.module)!r} ({type(call.module).__name__}) to its "
                f"{len(outs)} tensor outputs when re-running it. Register a rule for it with "
                "curvopt.layers.register; see docs/support.md#modules-without-a-rule."
            )
        return positions

    def _external_gradients(self, call, grad_out):
        """``(positions, grads)``: which of the module's tensor outputs the gradients belong to,
        and the gradients that reach each output from *outside* the module.

        The hooks see the total derivative of the loss w.r.t. each output. When one output is
        computed from another inside the module (``h = o * tanh(c)`` in ``LSTMCell``), the
        total gradient of ``c`` already contains the path through ``h``; back-propagating both
        through the module would count it twice. With ``D_ij`` the module-internal derivative
        of output ``i`` w.r.t. output ``j``, the totals are ``g_j = e_j + sum_i D_ij^T e_i``,
        solved for the external gradients ``e`` starting from the outputs nothing else
        depends on. Costs one eager forward of the batch; only for modules with several outputs
        that receive gradients."""
        count = len(grad_out)
        all_outs = self._eager_outputs(call)
        positions = self._grad_positions(call, count, all_outs)
        outs = [all_outs[i] for i in positions]
        with call.quiet(), torch.enable_grad():

            def pull(i, j, cotangent):
                return torch.autograd.grad(
                    outs[i], outs[j], cotangent, retain_graph=True, allow_unused=True
                )[0]

            depends = {
                (i, j): i != j and pull(i, j, torch.ones_like(outs[i])) is not None
                for i in range(count)
                for j in range(count)
            }
            external: List[Optional[torch.Tensor]] = [None] * count
            remaining = set(range(count))
            while remaining:
                ready = [j for j in remaining if not any(depends[i, j] for i in remaining)]
                for j in ready:
                    g = grad_out[j]
                    if g is not None:
                        for i in range(count):
                            if depends[i, j] and external[i] is not None:
                                g = g - pull(i, j, external[i])
                    external[j] = g
                remaining.difference_update(ready)
        return positions, tuple(external)

    def _eager_outputs(self, call) -> List[torch.Tensor]:
        """The module's tensor outputs re-computed on the whole batch with autograd, inputs
        requiring grad as they did in the recorded call."""

        def prep(x):
            if isinstance(x, torch.Tensor):
                return x.detach().requires_grad_(x.requires_grad)
            return x

        leaves, spec = tree_flatten((call.args, call.kwargs))
        args, kwargs = tree_unflatten([prep(x) for x in leaves], spec)
        with call.quiet(), torch.enable_grad():
            return output_tensors(call.module(*args, **kwargs))


class _OutputMismatch(Exception):
    """The re-run module has more tensor outputs than gradients arrived for."""


def _not_replayed(module, error: ReplayError) -> UnsupportedModuleError:
    return UnsupportedModuleError(
        f"curvopt cannot re-run module {module_name(module)!r} ({type(module).__name__}) "
        f"with the random numbers of its forward ({error}). Call .eval() on its random "
        "submodules or register a rule for it with curvopt.layers.register; see "
        "docs/support.md#dropout-and-random-numbers."
    )


def _first_line(error: Exception, limit: int = 120) -> str:
    """``Type: message`` of ``error``, its first line and at most ``limit`` characters of it
    (the whole error is chained: ``raise ... from error``)."""
    text = str(error).strip().splitlines()
    first = text[0] if text else ""
    if len(first) > limit:
        first = first[: limit - 3].rstrip() + "..."
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def _recorded(call):
    """``(root, index)``: the recorded call ``call`` derives from (``Call.origin``) and, for each
    of ``call``'s samples, the sample of ``root`` it is (an expanded call's pseudo-sample
    ``k N + n`` is sample ``n``)."""
    if call.origin is None:
        return call, torch.arange(call.batch_size)
    kind, parent, *rest = call.origin
    root, index = _recorded(parent)
    if kind == "slice":
        return root, index[rest[0] : rest[1]]
    columns = rest[0]
    k = (
        columns if isinstance(columns, torch.Tensor) else next(c for c in columns if c is not None)
    ).shape[0]
    return root, index.repeat(k)


def _unsqueeze(x, dim):
    return x.unsqueeze(dim)


GENERIC = register_fallback(GenericRule())


@register(nn.PReLU, nn.SyncBatchNorm)
class CurvatureFreeGenericRule(GenericRule):
    """The generic rule for modules that are linear in their input (``SyncBatchNorm`` in eval
    mode) or, ``PReLU``, piecewise linear in it and linear in their own leaf weight, whose
    second derivatives are then all off the diagonal (weight x upstream parameters)."""

    curvature_free = True
