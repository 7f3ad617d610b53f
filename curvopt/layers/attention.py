"""``nn.MultiheadAttention`` as a layer of linear maps around an attention core.

With the batch first (``[N, L, E]`` queries, ``[N, S, ·]`` keys and values), torch computes

* ``[q; k; v] = x W_inᵀ + b_in``: ``in_proj_weight [3E, E]`` on the queries, keys and values
  (``q_proj_weight``/``k_proj_weight``/``v_proj_weight`` when ``kdim``/``vdim`` differ from
  ``E``, ``in_proj_bias [3E]`` either way); ``bias_k``/``bias_v`` appended to the keys and
  values (``add_bias_kv``);
* ``o = core(q, k, v)``: the heads' attention with its masks, zero attention
  (``add_zero_attn``) and, in training mode, dropout on the attention weights;
* ``y = o W_outᵀ + b_out``: ``out_proj``, called functionally (its module hooks never fire).

The rule re-runs the core once on the whole batch, from the projections it computes as torch
does, by torch's own ``F.multi_head_attention_forward`` with identity projections (so the
masks, ``is_causal``, ``add_zero_attn`` and the dropout call are torch's; multiplying by an
identity matrix is exact), replaying the generator state the forward started from
(``Call.random``): the same dropout masks. The core's vector-Jacobian products give, for the
output gradient or any columns ``c`` at ``y``, the gradients ``g_q, g_k, g_v`` at the
projections and ``c W_out`` at ``o``. Every parameter is then a linear map read as
``nn.Linear`` reads its rows (``g_n(W) = Σ_t g_nt x_ntᵀ``):

* ``out_proj.weight``: rows ``(c_t, o_t)`` over the ``L`` query positions;
* ``in_proj_weight``: the one map ``x -> [q; k; v]`` on the positions it is applied to, as
  ``nn.Linear(E, 3E)`` applied to them would be: the ``L`` positions with rows
  ``([g_q, g_k, g_v], x)`` when query, key and value are one tensor (self-attention); else the
  query positions with ``([g_q, 0, 0], x_q)`` and the key positions with ``([0, g_k, g_v], x_k)``
  (key and value one tensor) or ``([0, g_k, 0], x_k)``, ``([0, 0, g_v], x_v)``;
* ``q/k/v_proj_weight``: three maps, rows ``(g_q, x_q)``, ``(g_k, x_k)``, ``(g_v, x_v)``;
* the biases (``in_proj_bias``, ``out_proj.bias``, ``bias_k``, ``bias_v``): the sums over
  positions; their Kronecker form is the exact block.

The Kronecker factors come from these rows with ``layers.kron`` (positions as the shared dim,
"expand" or "reduce"), the eigen-corrected moment from them with ``layers.eigenbasis``.
Per-sample quantities are exact: the core does not mix samples.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from curvopt.errors import UnsupportedModuleError, module_name
from curvopt.layers.eigenbasis import eigen_moment, eigen_moment_of
from curvopt.layers.kron import input_factor, output_factor
from curvopt.layers.registry import LayerRule, register

_WEIGHTS = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "out_proj.weight")


@dataclass
class _Core:
    """One call's attention core, re-run on the whole batch (sequence first, as torch runs
    it): the projections ``q [L, N, E]``, ``k``, ``v [S, N, E]`` and appended ``bias_k``/
    ``bias_v`` rows ``[1, N, E]`` as leaves, the outputs ``o [L, N, E]`` (before ``out_proj``)
    and the attention weights (or ``None``), and the inputs batch first with how they are
    shared (``"self"``: query, key and value one tensor; ``"kv"``: key and value one tensor;
    ``"none"``)."""

    leaves: Tuple[torch.Tensor, ...]
    outputs: Tuple[torch.Tensor, Optional[torch.Tensor]]
    x_q: torch.Tensor
    x_k: torch.Tensor
    x_v: torch.Tensor
    sharing: str


@register(nn.MultiheadAttention)
class MultiheadAttentionRule(LayerRule):
    """Attention calls its projections functionally, so the rule owns ``out_proj`` too."""

    owns_children = True
    replays_random_forward = True

    def batch_dim(self, module):
        return 0 if module.batch_first else 1

    def output_batch_dims(self, module, count):
        # attn_output follows batch_first; the attention weights are always [N, ...]
        return [self.batch_dim(module), 0][:count]

    def draws_random(self, module):
        return module.training and module.dropout > 0

    def vector_parameter(self, name, p):
        return p.dim() == 1 or name in ("bias_k", "bias_v")

    # ------------------------------------------------------------------ per-sample gradients
    def batch_grad(self, call, name, out=None):
        root, start, stop, columns = _resolve(call)
        if columns is None:
            grads = root.cache.setdefault("attention_grads", {})
            if name not in grads:
                grads[name] = self._grad(root, name, None)
            result = grads[name][start:stop]
        else:  # pseudo-samples k * n + i of an expanded call
            result = self._grad(root, name, _embedded(root, columns, start, stop))
            result = result[:, start:stop].flatten(0, 1)
        return result if out is None else out.copy_(result)

    def column_grads(self, call, columns, name):
        root, start, stop, given = _resolve(call)
        if given is not None:
            return super().column_grads(call, columns, name)
        grads = self._grad(root, name, _embedded(root, columns, start, stop))
        return grads[:, start:stop].transpose(0, 1)

    def _grad(self, root, name, columns) -> torch.Tensor:
        """The per-sample gradients ``[N, *p.shape]`` of ``name`` (``[K, N, *p.shape]`` for
        ``columns [K, *out]``) from its rows."""
        g, x = self._rows(root, name, columns)
        shape = root.module.get_parameter(name).shape
        return (g.sum(-2) if x is None else g.transpose(-1, -2) @ x).reshape(*g.shape[:-2], *shape)

    # ------------------------------------------------------------------ Kronecker factors
    def kron_output_factor(self, call, columns, name, approx, n):
        if name not in _WEIGHTS:
            return None  # the exact block of a bias (layers.kron)
        root, start, stop, _ = _resolve(call)
        g, _ = self._rows(root, name, _embedded(root, columns, start, stop), need_x=False)
        return output_factor(g[:, start:stop], approx)

    def kron_input_factor(self, call, name, approx, n):
        root, start, stop, _ = _resolve(call)
        return input_factor(self._inputs(root, name)[start:stop], approx)

    def eigen_correction(self, call, name, bases):
        root, start, stop, _ = _resolve(call)
        if name not in _WEIGHTS or len(bases) != 2:
            return eigen_moment_of(self.batch_grad(call, name), bases)
        g, x = self._rows(root, name, None)
        return eigen_moment(g[start:stop], x[start:stop], bases)

    # ------------------------------------------------------------------ the rows
    def _rows(self, root, name, columns, need_x=True):
        """``(g [*K, N, P, O], x [N, P, I])`` of a weight, ``(g, None)`` of a bias: the
        gradient rows at the map's output (for the call's output gradient, or for ``columns``
        with their leading ``K``) and its inputs, over the positions it is applied to."""
        core = _core(root)
        bd = self.batch_dim(root.module)
        if name.startswith("out_proj."):
            g = _first(columns if columns is not None else root.grad_out)
            g = g.movedim(g.dim() - 3 + bd, g.dim() - 3)  # batch first
            return g, (_batch_first(core.outputs[0]) if name == "out_proj.weight" else None)
        g_q, g_k, g_v, g_bk, g_bv = _pulled(root, core, columns)
        if name in ("bias_k", "bias_v"):
            return (g_bk if name == "bias_k" else g_bv), None
        g_q, g_k, g_v = (_batch_first(g) for g in (g_q, g_k, g_v))
        if name == "in_proj_bias":
            return torch.cat([g_q.sum(-2), g_k.sum(-2), g_v.sum(-2)], -1).unsqueeze(-2), None
        if name != "in_proj_weight":  # one of three maps
            g = {"q_proj_weight": g_q, "k_proj_weight": g_k, "v_proj_weight": g_v}[name]
            return g, (self._inputs(root, name) if need_x else None)
        zero_q, zero_k = torch.zeros_like(g_q), torch.zeros_like(g_k)
        if core.sharing == "self":
            g = torch.cat([g_q, g_k, g_v], -1)
        elif core.sharing == "kv":
            g = torch.cat(
                [torch.cat([g_q, zero_q, zero_q], -1), torch.cat([zero_k, g_k, g_v], -1)], -2
            )
        else:
            g = torch.cat(
                [
                    torch.cat([g_q, zero_q, zero_q], -1),
                    torch.cat([zero_k, g_k, zero_k], -1),
                    torch.cat([zero_k, zero_k, g_v], -1),
                ],
                -2,
            )
        return g, (self._inputs(root, name) if need_x else None)

    def _inputs(self, root, name) -> torch.Tensor:
        """The inputs ``[N, P, I]`` of weight ``name`` over the positions it is applied to."""
        core = _core(root)
        if name == "out_proj.weight":
            return _batch_first(core.outputs[0])
        if name != "in_proj_weight":
            return {"q_proj_weight": core.x_q, "k_proj_weight": core.x_k}.get(name, core.x_v)
        if core.sharing == "self":
            return core.x_q
        if core.sharing == "kv":
            return torch.cat([core.x_q, core.x_k], 1)
        return torch.cat([core.x_q, core.x_k, core.x_v], 1)


def _resolve(call):
    """``(root, start, stop, columns)``: the recorded call ``call`` derives from
    (``Call.origin``), the samples ``start:stop`` of it that ``call`` holds, and, for an
    expanded call, its columns ``[K, *out]`` on those samples (else ``None``)."""
    if call.origin is None:
        return call, 0, _samples(call), None
    kind, parent, *rest = call.origin
    root, start, stop, columns = _resolve(parent)
    if kind == "expand" and columns is None:
        return root, start, stop, rest[0]
    if kind == "slice" and columns is None:
        return root, start + rest[0], start + rest[1], None
    raise NotImplementedError(f"curvopt: a {kind} of an expanded attention call")


def _samples(root) -> int:
    query = _bound(root)["query"]
    return query.shape[0 if root.module.batch_first else 1]


def _embedded(root, columns, start, stop):
    """Columns on samples ``start:stop`` placed among zeros for the whole batch (samples do not
    interact in attention: the zeros pull back to zeros)."""
    if start == 0 and stop == _samples(root):
        return columns
    bd = 0 if root.module.batch_first else 1
    n = _samples(root)

    def place(c, dim):
        if c is None:
            return None
        shape = list(c.shape)
        shape[dim] = n
        full = c.new_zeros(shape)
        full.narrow(dim, start, stop - start).copy_(c)
        return full

    if isinstance(columns, torch.Tensor):
        return place(columns, 1 + bd)
    return tuple(place(c, 1 + d) for c, d in zip(columns, (bd, 0)))


def _first(value):
    return value if isinstance(value, torch.Tensor) or value is None else value[0]


def _batch_first(x: torch.Tensor) -> torch.Tensor:
    """``[*K, L, N, E] -> [*K, N, L, E]``."""
    return x.transpose(-3, -2)


def _bound(call) -> dict:
    """The call's inputs by name, defaults included."""
    if "attention_inputs" not in call.cache:
        signature = inspect.signature(call.module.forward)
        bound = signature.bind(*call.args, **call.kwargs)
        bound.apply_defaults()
        call.cache["attention_inputs"] = dict(bound.arguments)
    return call.cache["attention_inputs"]


def _core(root) -> _Core:
    """The call's attention core, re-run once for the recorded call (``Call.shared``: every
    ``Call`` the passes make of it reads the same)."""
    cache = root.cache if root.shared is None else root.shared
    if "attention_core" not in cache:
        cache["attention_core"] = _rerun(root)
    return cache["attention_core"]


def _rerun(root) -> _Core:
    module = root.module
    inputs = _bound(root)
    query, key, value = inputs["query"], inputs["key"], inputs["value"]
    path = module_name(module)
    if query.dim() != 3:
        raise UnsupportedModuleError(
            f"curvopt needs batched inputs for module {path!r} (MultiheadAttention), got a "
            f"query of shape {tuple(query.shape)}. Add a batch dimension (unsqueeze(0))."
        )
    if root.module.training and module.dropout > 0 and root.random is None:
        raise UnsupportedModuleError(
            f"curvopt did not see the forward of module {path!r} (MultiheadAttention) draw "
            "its dropout masks. Call the model after curvopt.extend, with grad enabled."
        )
    sharing = "self" if (key is value and query is key) else ("kv" if key is value else "none")
    # sequence first as torch runs it, the identities of query, key and value kept
    if module.batch_first:
        q_in = query.transpose(0, 1)
        k_in = q_in if key is query else key.transpose(0, 1)
        v_in = k_in if value is key else value.transpose(0, 1)
    else:
        q_in, k_in, v_in = query, key, value
    key_padding_mask = F._canonical_mask(
        mask=inputs["key_padding_mask"],
        mask_name="key_padding_mask",
        other_type=F._none_or_dtype(inputs["attn_mask"]),
        other_name="attn_mask",
        target_type=query.dtype,
    )
    attn_mask = F._canonical_mask(
        mask=inputs["attn_mask"],
        mask_name="attn_mask",
        other_type=None,
        other_name="",
        target_type=query.dtype,
        check_other=False,
    )
    with torch.no_grad():
        if module._qkv_same_embed_dim:
            bias = None if module.in_proj_bias is None else module.in_proj_bias.detach()
            q, k, v = F._in_projection_packed(q_in, k_in, v_in, module.in_proj_weight, bias)
        else:
            biases = (None,) * 3 if module.in_proj_bias is None else module.in_proj_bias.chunk(3)
            q, k, v = F._in_projection(
                q_in,
                k_in,
                v_in,
                module.q_proj_weight,
                module.k_proj_weight,
                module.v_proj_weight,
                *biases,
            )
    n, e = q.shape[1], module.embed_dim
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    leaves = [q, k, v]
    eye = torch.eye(e, dtype=q.dtype, device=q.device)
    with torch.enable_grad(), _replayed(root):
        k_all, v_all = k, v
        if module.bias_k is not None:  # appended per sample, so that each sample's share is read
            bias_k, bias_v = (
                b.detach().expand(1, n, e).clone().requires_grad_()
                for b in (module.bias_k, module.bias_v)
            )
            leaves += [bias_k, bias_v]
            k_all, v_all = torch.cat([k, bias_k]), torch.cat([v, bias_v])
            attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
            if key_padding_mask is not None:
                key_padding_mask = F.pad(key_padding_mask, (0, 1))
        o, weights = F.multi_head_attention_forward(
            q,
            k_all,
            v_all,
            e,
            module.num_heads,
            None,
            None,
            None,
            None,
            module.add_zero_attn,
            module.dropout,
            eye,
            None,
            training=module.training,
            key_padding_mask=key_padding_mask,
            need_weights=inputs["need_weights"],
            attn_mask=attn_mask,
            use_separate_proj_weight=True,
            q_proj_weight=eye,
            k_proj_weight=eye,
            v_proj_weight=eye,
            average_attn_weights=inputs["average_attn_weights"],
            is_causal=inputs["is_causal"],
        )
    batch_first = (q_in.transpose(0, 1), k_in.transpose(0, 1), v_in.transpose(0, 1))
    return _Core(tuple(leaves), (o, weights), *batch_first, sharing)


def _replayed(root):
    """The forward's generator state replayed (attention dropout), or nothing to replay."""
    return root.random.replay() if root.random is not None else contextlib.nullcontext()


def _pulled(root, core: _Core, columns):
    """``(g_q, g_k, g_v [*K, L|S, N, E], g_bias_k, g_bias_v [*K, N, 1, E] or None)``: the
    core's vector-Jacobian product with the output gradient (or ``columns [K, *out]``)
    at ``y``, taken through ``out_proj`` to ``o`` (the last one kept: every parameter of the
    call reads the same columns)."""
    last = root.cache.get("attention_pulled")
    if last is not None and last[0] is columns:
        return last[1]
    pulled = _vjp(root, core, columns)
    root.cache["attention_pulled"] = (columns, pulled)
    return pulled


def _vjp(root, core: _Core, columns):
    module = root.module
    batched = columns is not None
    given = columns if batched else root.grad_out
    given = given if isinstance(given, tuple) else (given,)
    lead = 1 if batched else 0
    bd = 0 if module.batch_first else 1
    outputs, cotangents = [], []
    g_y = given[0]
    if g_y is not None:
        if bd == 0:
            g_y = g_y.movedim(lead, lead + 1)  # [*K, L, N, E] as the core runs
        outputs.append(core.outputs[0])
        cotangents.append(g_y @ module.out_proj.weight.detach())
    if len(given) > 1 and given[1] is not None:
        outputs.append(core.outputs[1])
        cotangents.append(given[1])
    grads = torch.autograd.grad(
        outputs,
        core.leaves,
        cotangents,
        retain_graph=True,
        allow_unused=True,
        is_grads_batched=batched,
    )
    columns_dims = cotangents[0].shape[:lead]  # [K] for columns, () for the gradient
    grads = [
        leaf.new_zeros((*columns_dims, *leaf.shape)) if g is None else g
        for g, leaf in zip(grads, core.leaves)
    ]
    if len(grads) == 3:
        return (*grads, None, None)
    g_bk, g_bv = (g.movedim(-2, -3) for g in grads[3:])  # [*K, 1, N, E] -> [*K, N, 1, E]
    return (*grads[:3], g_bk, g_bv)
