"""The factored Kronecker step of a layer, from the per-row factors of its gradient.

A layer whose rule gives the rows of its weight gradient (``LayerRule.gradient_rows``:
``Linear``, convolutions over their patches, ``Embedding``, Hugging Face's ``Conv1D``) has, as
the matrix ``G = [p.shape[0], -1]``, ``G = leftᵀ right`` with ``R`` rows (samples times
positions of all its calls in the pass), so its Kronecker-preconditioned gradient is::

    F_0⁻¹ G F_1⁻¹ = (F_0⁻¹ leftᵀ)(F_1⁻¹ rightᵀ)ᵀ

With dense inverses that costs ``2R(d_0² + d_1² + d_0·d_1)`` flops instead of
``2 d_0·d_1 (d_0 + d_1)``: far fewer for a wide layer with few rows (a 3136 → 1024 layer at
R = 128), whose dense product dominates a KFAC step once averaged factors are no longer low
rank.

:class:`FactorCapture` keeps the calls (inputs and output gradients) of the modules owning the
optimizer's parameters from the forward to the step (references to tensors autograd holds
anyway, plus the output gradients). It registers no hook of its own: it is a tap on the calls
``extend``'s hooks record (``ModuleEntry.taps`` in ``curvopt.core.extended``), handed each
call's record at its forward and its output gradient when that arrives. The calls are used
only where they give the gradient the step preconditions: :func:`reproduces` checks
``G v = leftᵀ(right v)`` on a random probe ``v`` to its rounding bound, so weight decay, loss
scaling, accumulation over passes the capture missed, or a use of the weight outside the
layer's call make the step take the dense product instead. Both are exact; only their cost differs.
"""

from __future__ import annotations

import weakref
from typing import Optional, Sequence, Tuple

import torch

from curvopt.layers import rule_for
from curvopt.inversion.factor_inverse import solver_flops
from curvopt.core.extended import module_entry
from curvopt.core.params import owners
from curvopt.core.records import Call

Factors = Tuple[torch.Tensor, torch.Tensor]


def _detached(value):
    return value.detach() if isinstance(value, torch.Tensor) else value


class FactorCapture:
    """The calls of the modules owning ``params`` whose rules give gradient rows, since
    :meth:`clear`; a tap on those modules' records until ``owner`` is collected."""

    def __init__(self, owner, params):
        self.calls: dict[int, list] = {}  # id(module) -> [[Call, grad_out or None] per call]
        self.sources: dict[int, tuple] = {}  # id(p) -> (module, name, rule)
        self.counts: dict[int, tuple] = {}  # id(p) -> (its calls' output shapes, rows R)
        self._entries: dict[int, list] = {}  # Record.seq -> its [Call, grad_out] in ``calls``
        tapped, owning = set(), owners(params)
        for p in params:
            if id(p) not in owning or p.dim() < 2:
                continue
            module, name = owning[id(p)]
            rule = rule_for(module)
            if rule.gradient_rows is None:
                continue
            self.sources[id(p)] = (module, name, rule)
            entry = module_entry(module)
            if id(module) not in tapped and entry is not None:
                tapped.add(id(module))
                entry.taps.append(self)
                weakref.finalize(owner, entry.taps.remove, self)

    def called(self, record) -> None:
        """A forward of a tapped module (with grad, not curvopt's own re-run: a module re-run
        under ``vmap`` for per-sample gradients has batched inputs that must not leak out):
        keep its inputs until its output gradient arrives."""
        if len(record.out_shapes) != 1:
            return
        args = tuple(_detached(a) for a in record.args)
        kwargs = {k: _detached(v) for k, v in record.kwargs.items()}
        entry = [Call(record.module, args, kwargs), None]
        self.calls.setdefault(id(record.module), []).append(entry)
        self._entries[record.seq] = entry

    def differentiated(self, record, grads) -> None:
        """The output gradient of a call kept by :meth:`called` (not of curvopt's own
        propagation of columns, during which the records' hooks are silent)."""
        entry = self._entries.get(record.seq)
        if entry is not None and grads[0] is not None:
            entry[1] = grads[0].detach()

    def _calls(self, param: torch.Tensor) -> Optional[list]:
        """``param``'s calls since :meth:`clear`, or None (none, or one without its gradient)."""
        source = self.sources.get(id(param))
        calls = None if source is None else self.calls.get(id(source[0]))
        if not calls or any(grad is None for _, grad in calls):
            return None
        return calls

    def row_count(self, param: torch.Tensor) -> Optional[int]:
        """``R`` of :meth:`factors` without forming them, where an earlier pass with the same
        output shapes formed them (the rows are a function of the shapes), else None: so that
        a step that is not cheaper factored (a convolution's ``R`` = samples x positions) forms
        its rows once, not at every step."""
        calls = self._calls(param)
        known = self.counts.get(id(param))
        if calls is None or known is None:
            return None
        return known[1] if known[0] == _shapes(calls) else None

    def factors(self, param: torch.Tensor) -> Optional[Factors]:
        """``(left, right)`` of ``param``'s calls, or None (none, or one without its gradient,
        or a call the rule gives no rows for)."""
        calls = self._calls(param)
        if calls is None:
            return None
        module, name, rule = self.sources[id(param)]
        rows = [rule.gradient_rows(Call(module, c.args, c.kwargs, g), name) for c, g in calls]
        if any(r is None for r in rows):
            return None
        if len(rows) == 1:
            left, right = rows[0]
        else:
            left = torch.cat([left for left, _ in rows])
            right = torch.cat([right for _, right in rows])
        self.counts[id(param)] = (_shapes(calls), len(left))
        return left, right

    def clear(self) -> None:
        self.calls.clear()
        self._entries.clear()


def _shapes(calls) -> tuple:
    """The output-gradient shapes of ``calls``: what their number of rows depends on."""
    return tuple(tuple(grad.shape) for _, grad in calls)


def reproduces(matrix: torch.Tensor, factors: Factors) -> bool:
    """Whether ``matrix`` (``[d_0, d_1]``) is ``leftᵀ right``:
    ``|G v − leftᵀ(right v)| ≤ 64 eps |left|ᵀ(|right| |v|)`` for a random ``v`` (rounding of both
    sides of an ``R``-term sum, with a margin)."""
    left, right = factors
    rows, columns = matrix.shape
    if right.shape[1] != columns or left.shape[1] != rows or len(left) != len(right):
        return False
    dtype = torch.promote_types(matrix.dtype, torch.float32)
    generator = torch.Generator(device=matrix.device).manual_seed(0)
    v = torch.randn(matrix.shape[1], generator=generator, device=matrix.device, dtype=dtype)
    left, right = left.to(dtype), right.to(dtype)
    error = (matrix.to(dtype) @ v - left.mT @ (right @ v)).abs()
    eps = max(torch.finfo(t.dtype).eps for t in (matrix, *factors))
    bound = 64 * eps * (left.abs().mT @ (right.abs() @ v.abs()))
    return bool((error <= bound).all())


def factored_cheaper(solvers: Sequence, out: int, inputs: int, rows: int) -> bool:
    """Whether ``(F_0⁻¹ leftᵀ)(F_1⁻¹ rightᵀ)ᵀ`` costs fewer flops than ``F_0⁻¹ G F_1⁻¹`` for
    ``R = rows`` (``factor_inverse.solver_flops`` for each side, plus the final product)."""
    left, right = solvers
    factored = solver_flops(left, out, rows) + solver_flops(right, inputs, rows)
    dense = solver_flops(left, out, inputs) + solver_flops(right, inputs, out)
    return factored + 2 * out * inputs * rows < dense
