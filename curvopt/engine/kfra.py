"""KFRA (Botev et al., 2017): Kronecker factors with recursively propagated batch-averaged GGN.

For a chain of ``Linear`` layers ``h_l = W_l x_l + b_l``, ``x_{l+1} = phi(h_l)`` (elementwise):

    B_L = sum_{n,k} v_nk v_nk^T                       (exact loss-Hessian factor at h_L)
    B_l = (W_{l+1}^T B_{l+1} W_{l+1}) * mean_n d_n d_n^T,   d_n = phi'(h_{l,n})

and ``p.kfra = [B_l, mean_n x_n x_n^T]`` (weight) or ``[B_l]`` (bias). With one sample the
recursion is exact, so KFRA equals KFLR there. Only ``O x O`` matrices are propagated, which
is why the recursion is restricted to feed-forward chains of ``Linear`` layers: for conv
feature maps the dense ``(C H W)^2`` matrices would not fit in memory. Which modules can be
links, their ``W`` and their factors, is their layer rule's to say
(``LayerRule.kfra_weight``, ``LayerRule.kfra_factors``).
"""

from __future__ import annotations

import torch
from curvopt.errors import module_error
from curvopt.layers.registry import reparametrization, rule_for
from curvopt.graph.search import search
from curvopt.core.params import trainable
from curvopt.graph.propagate import backpropagate
from curvopt.core.records import records_on
from curvopt.engine.results import Factors
from curvopt.autograd.torch_internals import ACCUMULATE_GRAD


def _reject(record, reason, fix="Use KFLR or KFAC"):
    """The error for ``record``'s module: ``reason`` (what breaks the chain), then ``fix``."""
    return module_error(record.module, f"KFRA: {reason}. {fix}; see docs/support.md#kfra.")


def _check_link(record, nxt, walk) -> None:
    """``nxt``'s input must be computed from ``record``'s output alone (no skip connection
    from an earlier layer, no parameter used outside a layer): the recursion is for chains."""

    def expand(node) -> list:
        owners = {entry[0] for entry in records_on(node)}
        if record in owners:
            return []
        if owners or type(node).__name__ == ACCUMULATE_GRAD:
            raise _reject(
                nxt,
                "its input is not computed from the previous Linear layer's output alone (a "
                "residual or skip connection, or a parameter used outside a layer)",
            )
        return walk.next_nodes(node)

    search([nxt.args[0].grad_fn], expand)


def _depth(record, walk) -> int:
    """How many module calls lie upstream of ``record``'s input: the chain's order (forward
    order, ``seq``, puts the calls of a re-run checkpoint segment last)."""
    x = record.args[0]
    owners = set()

    def expand(node) -> list:
        owners.update(entry[0] for entry in records_on(node))
        return walk.next_nodes(node)

    search([x.grad_fn if isinstance(x, torch.Tensor) else None], expand)
    return len(owners)


def _chain(calls, walk):
    records = sorted(calls, key=lambda record: _depth(record, walk))
    seen = set()
    for record in records:
        module = record.module
        if reparametrization(module) is not None:
            raise _reject(
                record,
                f"its parameter {reparametrization(module)} is reparametrized, so the layer's "
                "weight has no Kronecker factors",
                "Use a diagonal quantity",
            )
        if rule_for(module).kfra_weight(module) is None:
            raise _reject(
                record,
                "it is implemented for feed-forward chains of Linear layers and elementwise "
                "activations only",
            )
        if record.args[0].dim() != 2:
            raise _reject(record, "inputs with extra (sequence) dims are not supported", "Use KFLR")
        if module in seen:
            raise _reject(record, "a module used several times breaks the layer chain")
        seen.add(module)
    return records


def kfra(context, calls, exts):
    """``Factors`` of ``exts`` (``kfra``) of every Linear layer in the chain ending at the
    loss (``context``: the loss's ``loss_context.LossContext``)."""
    walk = context.walk
    records = _chain(calls, walk)
    if not records:
        return
    output = context.output
    last = records[-1]
    ((index, edge),) = calls[last]
    b = None
    for cols in context.exact_columns(1 << 30):
        (v,) = backpropagate(output, [edge], cols, context.batched, walk)
        v = last.at_parameter_precision(v.flatten(0, 1))
        b = v.T @ v if b is None else b.add_(v.T @ v)
    factors = {}
    for pos in range(len(records) - 1, -1, -1):
        record = records[pos]
        if pos < len(records) - 1:
            b = _backpropagate(b, record, records[pos + 1], calls, walk)
        factors[record] = b
    for record, b in factors.items():
        x = record.at_parameter_precision(record.args[0].detach())
        rule = rule_for(record.module)
        for name, p in trainable(record.module):
            for ext in exts:
                yield Factors(p, ext.attr, record, rule.kfra_factors(x, b, name), 0)


def _backpropagate(b_next, record, nxt, calls, walk):
    """``B_l`` from ``B_{l+1}``: through ``W_{l+1}`` and the elementwise map between them."""
    ((_, edge),) = calls[record]
    _check_link(record, nxt, walk)
    x_next = nxt.args[0]
    ones = torch.ones_like(x_next)
    probe = torch.randn_like(x_next)
    (both,) = backpropagate(x_next, [edge], torch.stack([ones, probe]), True, walk)
    if both is None or both.shape[1:] != x_next.shape:
        raise _reject(nxt, "its input is not computed from the previous Linear layer's output")
    d, dprobe = both[0], both[1]
    tol = 64 * torch.finfo(d.dtype).eps
    if not torch.allclose(dprobe, probe * d, rtol=tol, atol=tol * float(d.abs().max()) + 1e-12):
        raise _reject(
            nxt, "the map from the previous Linear layer's output to its input is not elementwise"
        )
    w = rule_for(nxt.module).kfra_weight(nxt.module).detach()
    d = nxt.at_parameter_precision(d)
    n = d.shape[0]
    return (w.T @ b_next @ w) * (d.T @ d / n)
