"""Residual terms of the Hessian diagonal: the curvature of elementwise nonlinearities.

``diag(H) = diag(G) + sum_a diag(J_a^T diag(r_a) J_a)`` where, for every curved elementwise op
``y = phi(u)`` in the graph, ``r_a = (dL/dy) * phi''(u)`` (per sample, at ``u``) and ``J_a`` is
the Jacobian of ``u`` w.r.t. the parameters. ``phi''`` is read off the autograd node's saved
tensors, so functional calls (``torch.sigmoid``, ``F.gelu``) are covered too.

Which modules need no look inside (linear in their input) and which give their term as a
weighted sum of squared inputs is their layer rule's to say (``LayerRule.curvature_free``,
``LayerRule.weighted_squares``).

Column budget: when ``u`` is directly the output of a layer whose rule has weighted squares
(Linear, Conv), that layer's term is a weighted sum of squared inputs (no columns); layers
further upstream receive ``sqrt(r+)`` and ``sqrt(r-)`` one-hot columns (``2 * numel(u) / N`` of
them) through autograd.
Any op whose curvature is unknown (products of two activations, softmax, normalisation inside
the graph...) raises an error naming it instead of returning a wrong diagonal.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch.autograd.graph import GradientEdge

from curvopt.errors import UnsupportedModuleError
from curvopt.engine.diagonals import diagonals
from curvopt.layers.registry import reparametrization, rule_for
from curvopt.graph.search import search
from curvopt.core.extended import module_path
from curvopt.core.params import owned
from curvopt.graph.propagate import backpropagate, to_calls
from curvopt.core.records import records_on
from curvopt.engine.results import Term
from curvopt.engine.rows import establish
from curvopt.autograd.second_derivatives import SECOND_DERIVATIVES
from curvopt.core.state import STATE
from curvopt.autograd.torch_internals import (
    ACCUMULATE_GRAD,
    BILINEAR_OPS,
    DIVISION,
    IN_PLACE_ON_VIEW,
    LINEAR_OPS,
    SavedTensorsApart,
    backward_with_graph,
    ones_of_input,
)
from curvopt.graph.walk import Walk


def _error(what: str) -> UnsupportedModuleError:
    return UnsupportedModuleError(
        f"DiagHessian: {what}. Use DiagGGNExact for this model; see docs/support.md#diaghessian "
        "for the layers and ops DiagHessian supports."
    )


def curved_nodes(root: torch.Tensor, walk) -> List[Tuple[object, Optional[torch.Tensor]]]:
    """``(node, phi'')`` for the autograd nodes of curved elementwise ops upstream of ``root``
    (``phi''`` computed here for in-place ops on views, else ``None``: read off the node by
    ``SECOND_DERIVATIVES``); errors on unknown ops. (Module calls are stepped over, from their
    output to their input; the edges are read off ``walk``, the loss's ``walk.Walk``.)"""
    found = []

    def expand(node) -> list:
        entries = records_on(node)
        if entries:
            record = entries[0][0]
            module = record.module
            how = reparametrization(module)
            if how is not None:
                raise _error(
                    f"module {module_path(module)!r} ({type(module).__name__}) has the "
                    f"reparametrized parameter {how}, whose weight is nonlinear in the "
                    "originals"
                )
            if not rule_for(module).curvature_free:
                raise _error(
                    f"module {module_path(module)!r} ({type(module).__name__}) is curved in its "
                    "input, or its rule does not declare curvature_free"
                )
            x = record.args[0]
            return [x.grad_fn] if isinstance(x, torch.Tensor) else []
        if walk.segment_of(node) is not None:  # a reentrant checkpoint curvopt re-ran: its re-run
            return walk.next_nodes(node)
        name = type(node).__name__
        if name in SECOND_DERIVATIVES:
            found.append((node, None))
        elif name == IN_PLACE_ON_VIEW:
            second = _in_place_second_derivative(node, walk.next_of(node))
            if second is not None:
                found.append((node, second))
        elif name in BILINEAR_OPS:
            _check_bilinear(node, name, walk)
        elif name not in LINEAR_OPS:
            raise _error(f"the op {name} has curvature curvopt cannot account for")
        return [fn for fn, _ in walk.next_of(node)]

    search([root.grad_fn], expand)
    return found


def _check_bilinear(node, name: str, walk) -> None:
    """Raise unless the product ``node`` is linear in each parameter on its own (then the
    diagonal has no term from it): at most one operand computed from parameters, no raw
    parameter ``w`` in two operands (``w * w``, ``tanh(w x) * w``: curved in ``w``), and a
    divisor free of parameters (``x / w`` is curved in ``w``: ``2x/w³``)."""
    operands = [fn for fn, _ in walk.next_of(node)]
    if name == DIVISION and operands[1] is not None:
        raise _error(f"the op {name} divides by a parameter-dependent tensor (curved in it)")
    present = [fn for fn in operands if fn is not None]
    computed = [fn for fn in present if type(fn).__name__ != ACCUMULATE_GRAD]
    if len(computed) > 1:
        raise _error(f"the op {name} multiplies two parameter-dependent tensors")
    leaves = [fn for fn in present if type(fn).__name__ == ACCUMULATE_GRAD]
    if len(set(leaves)) < len(leaves) or any(_reaches(c, set(leaves), walk) for c in computed):
        raise _error(f"the op {name} multiplies a parameter by a tensor computed from it")


def _reaches(node, targets: set, walk) -> bool:
    """Whether one of the nodes ``targets`` is upstream of ``node`` (module calls stepped over
    from their output to their input, as in :func:`curved_nodes`)."""
    met = []

    def expand(node) -> list:
        if met or node in targets:
            met.append(node)
            return []
        entries = records_on(node)
        if entries:
            x = entries[0][0].args[0]
            return [x.grad_fn if isinstance(x, torch.Tensor) else None]
        return walk.next_nodes(node)

    search([node], expand)
    return bool(met)


def _in_place_second_derivative(node, edges) -> Optional[torch.Tensor]:
    """``phi''(u)`` at the base ``u`` of an in-place op on a view (``CopySlices``, whose op
    Python cannot name), ``None`` where it is zero: the op's backward is run again on ones with
    its graph (``g_i = ∂(1ᵀ y)/∂x_i`` for its inputs ``x_i``) and differentiated once more.
    ``∂(1ᵀ g_0)/∂u`` is ``phi''`` if ``phi`` is elementwise (checked with a sign vector); every
    other second derivative must vanish, except between a parameter itself and another operand
    (``h *= w``), which the diagonal does not see: ``h += o`` and ``h *= 2`` are linear,
    ``h *= o`` with ``o`` computed from the parameters raises."""
    with STATE.suspend():  # curvopt's own differentiation: no hooks
        return _in_place_second(edges, backward_with_graph(node, (ones_of_input(node, 0),)))


def _in_place_second(edges, grads) -> Optional[torch.Tensor]:
    """``_in_place_second_derivative`` from the gradients ``grads`` of its inputs ``edges``."""
    second = None
    for i, (g, (fn_i, _)) in enumerate(zip(grads, edges)):
        if fn_i is None or g is None or not g.requires_grad:
            continue
        for j, (fn_j, nr_j) in enumerate(edges):
            leaf = ACCUMULATE_GRAD in (type(fn_i).__name__, type(fn_j).__name__)
            if fn_j is None or (i != j and leaf):
                continue
            source = GradientEdge(fn_j, nr_j)
            (d,) = torch.autograd.grad(g, source, torch.ones_like(g), True, allow_unused=True)
            if d is None or not bool(d.any()):
                continue
            if i or j:
                raise _error(
                    "an in-place op on a view (CopySlices) is curved in an operand other than "
                    "the tensor it modifies, or multiplies two parameter-dependent tensors"
                )
            signs = torch.randint(0, 2, g.shape, generator=torch.Generator().manual_seed(0))
            signs = (2 * signs - 1).to(g)
            (ds,) = torch.autograd.grad(g, source, signs, True)
            if not torch.allclose(ds, d * signs, rtol=1e-5, atol=1e-12 * float(d.abs().max())):
                raise _error("an in-place op on a view (CopySlices) is curved and not elementwise")
            second = d
    return second


def _weighted_squares(record, r: torch.Tensor, name: str, batched: bool) -> torch.Tensor:
    """``sum_j r_j (d u_j / d p)^2`` for ``u`` the output of ``record``'s module (its rule's
    :meth:`LayerRule.weighted_squares`), at the parameters' precision."""
    x, r = record.at_parameter_precision((record.args[0], r))
    return rule_for(record.module).weighted_squares(record.module, x, r, name, batched)


def _reject_shared(calls) -> None:
    """A parameter reached through several calls has cross second derivatives between its uses
    (``W f(W x)`` is bilinear in ``W``), which the residual terms do not include."""
    seen = {}
    for record in calls:
        for name, p in owned(record.module):
            if id(p) in seen:
                raise _error(
                    f"parameter {name!r} of module {module_path(record.module)!r} is used by "
                    "several calls (a reused module or tied weights), whose cross second "
                    "derivatives are not implemented"
                )
            seen[id(p)] = record


def _reject_enclosing(node, calls, upstream: Walk) -> None:
    """Raise for a call whose parameter is upstream of the curved op ``node`` although the call
    itself is not: its module encloses the op (a model owning a raw parameter, ``self.l(tanh(x
    * self.scale))``), and its rule reads columns only at its own output, downstream of the
    op, so the op's term ``J_aᵀ diag(r_a) J_a`` would never reach the parameter."""
    for record in calls:
        if record in upstream.calls:
            continue
        for name, p in owned(record.module):
            if p.requires_grad and id(p) in upstream.accumulators:
                raise _error(
                    f"parameter {name!r} of module {module_path(record.module)!r} "
                    f"({type(record.module).__name__}) feeds the curved op "
                    f"{type(node).__name__} inside the module's own call, whose term curvopt "
                    "cannot give it"
                )


def residuals(context, gradient, calls, exts):
    """``Term``s: the residual terms of ``exts`` (``diag_h``/``diag_h_batch``) of every
    parameter, one at a time (``context``: the loss's ``loss_context.LossContext``;
    ``gradient()``: ``dL/d output`` of the loss as it enters the pass, asked only where a
    curved op lies upstream of the loss)."""
    _reject_shared(calls)
    output, walk = context.output, context.walk
    nodes = curved_nodes(output, walk)
    if not nodes:
        return
    edges = [GradientEdge(nd, 0) for nd, _ in nodes]
    deltas = backpropagate(output, edges, gradient()[None], False, walk)
    producers = {}
    for record, edges in calls.items():
        for i, edge in edges:
            producers[(edge.node, edge.output_nr)] = record, i
    apart = SavedTensorsApart()  # inside a non-reentrant checkpoint: torch's backward reads too
    for (node, second), delta in zip(nodes, deltas):
        if delta is None:
            continue
        if second is None:
            with apart, STATE.suspend():
                second = SECOND_DERIVATIVES[type(node).__name__](node)
        r = delta[0] * second
        fn, nr = walk.next_of(node)[0]
        if fn is None:
            continue
        direct, index = producers.get((fn, nr), (None, None))
        upstream = Walk(fn, within=walk)  # a part of the loss's walk, read again
        _reject_enclosing(node, calls, upstream)
        others = {record: calls[record] for record in upstream.calls if record in calls}
        if direct is not None and rule_for(direct.module).has_weighted_squares(direct.module):
            # in the call's output shape: an in-place op on a view modifies the output's base
            # (a Linear on [N, T, D] returns a view of its [N T, D'] product), of r's shape
            own = r.reshape(direct.out_shapes[index])
            for ext in exts:
                batched = ext.quantity.per_sample
                for name, p in owned(direct.module):
                    if p.requires_grad:
                        yield Term(p, ext.attr, _weighted_squares(direct, own, name, batched))
            others.pop(direct)
        if others:
            source = GradientEdge(fn, nr)
            layout = establish(
                source, r.shape, others, upstream.batchable, upstream, elementwise=True
            )
            yield from _columns(source, r, others, exts, upstream, layout)


def _columns(source, r: torch.Tensor, calls, exts, walk, layout):
    """Signed one-hot columns ``sqrt(|r|)`` at ``u`` (one per element of a row, packed over
    rows by ``layout``), propagated to the modules upstream (``walk``: the graph from
    ``source``)."""
    flat = r.reshape(r.shape[0], -1)
    size = flat.shape[1]
    per_column = flat.numel() + sum(rec.out_numel[i] for rec in calls for i, _ in calls[rec])
    chunk = max(1, (1 << 24) // (per_column * layout.num_slots))
    eye = torch.eye(size, dtype=r.dtype, device=r.device)
    for sign, part in ((1.0, flat.clamp(min=0)), (-1.0, (-flat).clamp(min=0))):
        root = part.sqrt()
        if not bool(root.any()):
            continue
        for start in range(0, size, chunk):
            stop = min(size, start + chunk)
            cols = (eye[start:stop, None, :] * root[None]).reshape(stop - start, *r.shape)
            cols = layout.pack(cols, 0, layout.num_slots)
            outs = to_calls(source, calls, cols, walk.batchable, walk)
            yield from diagonals(calls, outs, exts, sign)
