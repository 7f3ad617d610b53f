"""``nn.RNN``, ``nn.LSTM`` and ``nn.GRU`` (any ``num_layers``, bidirectional, ``batch_first`` or
not): per-sample quantities by one batched re-run with a copy of the weights per sample.

The recurrence is re-run unrolled (PyTorch's gate equations, ``torch.nn.LSTM`` docs) on the
recorded inputs with weights ``W_n = W`` expanded over the batch (``[N, *p.shape]``, no copy);
one backward pass of the output gradients through it gives ``dL/dW_n = g_n`` for every sample
at once (the fused kernels cannot be ``vmap``-ed). Outputs: ``output`` (batch along dim 0 or 1
as ``batch_first`` says) and ``h_n``/``c_n`` (``[layers * dirs, N, H]``, batch along dim 1).

Curvature diagonals treat the ``K`` propagated columns as ``K N`` pseudo-samples of the same
re-run (:meth:`RecurrentRule.column_diag`). Not supported, with an error: ``proj_size > 0``,
dropout between layers in training mode, packed sequences, unbatched inputs, and Kronecker
factors (there is no Kronecker structure for the recurrent weights here).
"""

from __future__ import annotations

from typing import Dict, List

import torch
from torch import nn

from curvopt.errors import kronecker_error, module_error
from curvopt.layers.registry import LayerRule, register
from curvopt.core.reductions import squared_norms, sum_of_squares

#: elements of per-(pseudo-)sample gradients held at once
_CHUNK_ELEMENTS = 1 << 22


def _step(mode, gi, gh, h, c):
    """One time step from the input and hidden projections ``gi``/``gh`` ``[N, G H]``."""
    if mode == "LSTM":
        i, f, g, o = (gi + gh).chunk(4, 1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c
    if mode == "GRU":
        ir, iz, in_ = gi.chunk(3, 1)
        hr, hz, hn = gh.chunk(3, 1)
        r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
        n = torch.tanh(in_ + r * hn)
        return (1 - z) * n + z * h, None
    act = torch.tanh if mode == "RNN_TANH" else torch.relu
    return act(gi + gh), None


def _project(w, b, x):
    """``x W_nᵀ + b_n`` with per-sample ``w [N, G, I]``, ``b [N, G]``; ``x [N, (T,) I]``."""
    out = torch.einsum("ngi,n...i->n...g", w, x)
    if b is not None:
        out = out + (b if x.dim() == 2 else b.unsqueeze(1))
    return out


def unrolled(module, x, h0, c0, weights):
    """``(output [N, T, D H], h_n [N, L D, H], c_n or None)`` of ``module`` on batch-first
    ``x [N, T, I]`` and initial states ``[N, L D, H]``, with per-sample ``weights``."""
    mode, dirs = module.mode, 2 if module.bidirectional else 1
    inp, hs, cs = x, [], []
    for layer in range(module.num_layers):
        outs = []
        for d in range(dirs):
            sfx = f"_l{layer}" + ("_reverse" if d else "")
            w_ih, w_hh = weights[f"weight_ih{sfx}"], weights[f"weight_hh{sfx}"]
            b_ih, b_hh = weights.get(f"bias_ih{sfx}"), weights.get(f"bias_hh{sfx}")
            h = h0[:, layer * dirs + d]
            c = c0[:, layer * dirs + d] if c0 is not None else None
            seq = inp.flip(1) if d else inp
            gi = _project(w_ih, b_ih, seq)
            steps = []
            for t in range(seq.shape[1]):
                h, c = _step(mode, gi[:, t], _project(w_hh, b_hh, h), h, c)
                steps.append(h)
            out = torch.stack(steps, 1)
            outs.append(out.flip(1) if d else out)
            hs.append(h)
            cs.append(c)
        inp = torch.cat(outs, 2)
    return inp, torch.stack(hs, 1), torch.stack(cs, 1) if c0 is not None else None


@register(nn.RNNBase, nn.RNN, nn.LSTM, nn.GRU)
class RecurrentRule(LayerRule):
    def batch_dim(self, module):
        return 0 if module.batch_first else 1

    def output_batch_dims(self, module, count):
        return [self.batch_dim(module), 1, 1][:count]

    def check(self, module):
        if getattr(module, "proj_size", 0) > 0:
            return "LSTM with proj_size > 0 is not supported. Use proj_size=0."
        if module.training and module.dropout > 0 and module.num_layers > 1:
            return (
                "dropout between recurrent layers in training mode cannot be re-run "
                "identically. Call .eval() on the layer or set dropout=0."
            )
        return None

    # ------------------------------------------------------------------ inputs and outputs
    def _inputs(self, call):
        """Batch-first ``x [N, T, I]`` and initial states ``[N, L D, H]`` (zeros if absent)."""
        module = call.module
        x = call.args[0] if call.args else call.kwargs.get("input")
        if not isinstance(x, torch.Tensor):
            raise module_error(
                module,
                "packed sequences are not supported. Pass a padded tensor (and mask the loss) "
                "instead.",
            )
        if x.dim() != 3:
            raise module_error(module, "its input is unbatched (2-D). Add a batch dimension.")
        hx = call.args[1] if len(call.args) > 1 else call.kwargs.get("hx")
        x = x.detach()
        if module.batch_first is False:
            x = x.transpose(0, 1)
        n = x.shape[0]
        layers = module.num_layers * (2 if module.bidirectional else 1)
        shape = (n, layers, module.hidden_size)
        if hx is None:
            zeros = x.new_zeros(shape)
            return x, zeros, zeros if module.mode == "LSTM" else None
        if module.mode == "LSTM":
            h0, c0 = hx
            return x, h0.detach().transpose(0, 1), c0.detach().transpose(0, 1)
        return x, hx.detach().transpose(0, 1), None

    def _grads(self, call, grad_out):
        """The output gradients, batch first: ``[N, T, D H]``, ``[N, L D, H]`` (or None)."""
        grads = grad_out if isinstance(grad_out, tuple) else (grad_out,)
        grads = list(grads) + [None] * (3 - len(grads))
        out, h, c = grads
        if out is not None and not call.module.batch_first:
            out = out.transpose(0, 1)
        return [
            out,
            None if h is None else h.transpose(0, 1),
            None if c is None else c.transpose(0, 1),
        ]

    # ------------------------------------------------------------------ per-sample gradients
    def _per_sample(self, call, x, h0, c0, grads) -> Dict[str, torch.Tensor]:
        """``name -> [N, *p.shape]`` of ``call``'s module for the batch-first inputs and output
        gradients (re-run with curvopt's hooks silenced, ``call.quiet``)."""
        module = call.module
        n = x.shape[0]
        copies = {
            name: p.detach().expand(n, *p.shape).requires_grad_()
            for name, p in module.named_parameters()
            if p.requires_grad
        }
        with call.quiet(), torch.enable_grad():
            outs = unrolled(module, x, h0, c0, copies)
            pairs = [(o, g) for o, g in zip(outs, grads) if o is not None and g is not None]
            found = torch.autograd.grad(
                [o for o, _ in pairs],
                list(copies.values()),
                [g for _, g in pairs],
                allow_unused=True,
            )
        return {
            name: torch.zeros_like(c) if g is None else g
            for (name, c), g in zip(copies.items(), found)
        }

    def _all(self, call) -> Dict[str, torch.Tensor]:
        if "recurrent" not in call.cache:
            x, h0, c0 = self._inputs(call)
            call.cache["recurrent"] = self._per_sample(
                call, x, h0, c0, self._grads(call, call.grad_out)
            )
        return call.cache["recurrent"]

    def batch_grad(self, call, name, out=None):
        result = self._all(call)[name]
        return result if out is None else out.copy_(result)

    def batch_l2(self, call, name):
        return squared_norms(self._all(call)[name])

    def sum_grad_squared(self, call, name):
        return sum_of_squares(self._all(call)[name])

    def grad_sum(self, call, name):
        return self._all(call)[name].sum(0)

    # ------------------------------------------------------------------ curvature
    def column_grads(self, call, columns, name):
        """``[N, K, *p]``: the ``K`` columns as ``K N`` pseudo-samples of one re-run."""
        return self._columns(call, columns)[name]

    def column_diag(self, call, columns, name, batched):
        grads = self._columns(call, columns, squared=True, batched=batched)
        return grads[name]

    def _columns(self, call, columns, squared=False, batched=False):
        key = ("recurrent_columns", id(columns), squared, batched)
        if key in call.cache:
            return call.cache[key]
        module = call.module
        x, h0, c0 = self._inputs(call)
        cols = self._grads_columns(call, columns)  # [K, N, ...] batch first
        k = next(c for c in cols if c is not None).shape[0]
        n = x.shape[0]
        numel = sum(p.numel() for p in module.parameters() if p.requires_grad)
        step = max(1, _CHUNK_ELEMENTS // max(1, numel * n))
        parts: Dict[str, List[torch.Tensor]] = {}
        for start in range(0, k, step):
            stop = min(k, start + step)
            kk = stop - start

            def rep(t, kk=kk):
                return None if t is None else t.unsqueeze(0).expand(kk, *t.shape).flatten(0, 1)

            chunk = [None if c is None else c[start:stop].flatten(0, 1) for c in cols]
            grads = self._per_sample(call, rep(x), rep(h0), rep(c0), chunk)
            for name, g in grads.items():
                g = g.view(kk, n, *g.shape[1:])
                if squared:
                    g = g.square().sum(0) if batched else g.square().sum((0, 1))
                else:
                    g = g.transpose(0, 1)
                parts.setdefault(name, []).append(g)
        result = {
            name: (torch.stack(v).sum(0) if squared else torch.cat(v, 1))
            for name, v in parts.items()
        }
        call.cache[key] = result
        return result

    def _grads_columns(self, call, columns):
        """Columns ``[K, *out_i]`` per output, batch first: ``[K, N, ...]``."""
        cols = columns if isinstance(columns, tuple) else (columns,)
        cols = list(cols) + [None] * (3 - len(cols))
        out, h, c = cols
        if out is not None and not call.module.batch_first:
            out = out.transpose(1, 2)
        return [
            out,
            None if h is None else h.transpose(1, 2),
            None if c is None else c.transpose(1, 2),
        ]

    def kron_output_factor(self, call, columns, name, approx, n):
        raise kronecker_error(
            call.module, f"parameter {name!r}", "curvopt has none for recurrent layers"
        )
