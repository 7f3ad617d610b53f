"""The checks of one backward pass, each raising before anything is written, and the one
tolerance policy they share.

* every parameter that received a gradient was seen through its module's call;
* the per-sample gradients of each parameter sum to its gradient (a parameter also used
  outside its module, e.g. a tied head ``h @ emb.weight.T``, breaks this);
* for curvature, each module's output gradient is what the extended losses send it (nothing
  from other terms of the objective), and every parameter with a gradient gets every
  requested curvature attribute.

Tolerance: a comparison of ``a`` with ``b`` fails beyond ``factor * eps * max(|a|, |b|)``, with
``eps`` the unit roundoff of the least precise dtype involved, or of the computation that made
them (an autocast call computes in a lower precision than its parameters: ``note_precision``).
The sum check has two tiers: the cheap bound above (``factor`` 64), then, for the sums that
miss it, the rounding bound ``8 eps (sum_n |g_n| + |grad|) + 1000 eps max |grad of the pass|``.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from curvopt.errors import UnsupportedModuleError, module_error
from curvopt.reducer import reduce_in_chunks
from curvopt.reductions import probe_columns
from curvopt.results import name_of


def roundoff(*tensors, floor: float = 0.0) -> float:
    """Unit roundoff of the least precise floating dtype among ``tensors``, at least ``floor``."""
    eps = [torch.finfo(t.dtype).eps for t in tensors if t is not None and t.is_floating_point()]
    return max([floor, *eps])


def mismatch(a, b, factor: float, floor: float = 0.0) -> bool:
    """``|a - b|`` beyond ``factor * roundoff(a, b, floor) * max(|a|, |b|)`` somewhere (the
    roundoff of both dtypes; ``b`` is compared in ``a``'s dtype)."""
    if not a.numel():
        return False
    eps = roundoff(a, b, floor=floor)
    b = b.to(a.dtype)
    scale = torch.maximum(a.abs().max(), b.abs().max())
    return bool((a - b).abs().max() > factor * eps * scale)  # one sync


def dense(grad: torch.Tensor) -> torch.Tensor:
    """A sparse gradient (``nn.Embedding(sparse=True)``) as the dense tensor it stands for."""
    return grad.coalesce().to_dense() if grad.is_sparse else grad


class Checks:
    """What the checks of one pass have seen so far."""

    def __init__(self):
        self.totals: Dict[int, Tuple[list, torch.Tensor]] = {}  # id(p): uses, sum_n g_n
        self.param_grads: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}  # id(p): p, grad
        self.seen: set = set()  # ids of parameters whose module call was processed
        self.suspects: list = []  # (p, sum_n g_n, grad, sum_n |g_n|) beyond the cheap bound
        self.compute_eps: Dict[int, float] = {}  # id(p): roundoff of autocast calls using p
        self.expected: Dict[object, list] = {}  # record: the extended losses' output gradients

    def note_precision(self, record, params) -> None:
        """A call computed in a lower precision than its parameters (autocast) makes ``p.grad``
        that precise only: the sum checks use its roundoff."""
        for _, p in params:
            if record.dtype != p.dtype and p.is_floating_point():
                eps = torch.finfo(record.dtype).eps
                self.compute_eps[id(p)] = max(eps, self.compute_eps.get(id(p), 0.0))

    # ------------------------------------------------------------ curvature: output gradients
    def expect_gradients(self, grads) -> None:
        """Add one extended loss's share ``{record: [grad per output]}`` of the gradients the
        module hooks will see."""
        for record in grads:
            old = self.expected.get(record)
            new = grads[record]
            if old is None:
                self.expected[record] = list(new)
            else:
                self.expected[record] = [
                    b if a is None else a if b is None else a + b for a, b in zip(old, new)
                ]

    def check_expected(self, record, grads) -> None:
        """The module's output gradients must come from the extended losses alone."""
        expected = self.expected.get(record)
        for index, grad in enumerate(grads):
            if grad is None:
                continue
            want = None if expected is None else expected[index]
            bad = bool(grad.any()) if want is None else mismatch(want, grad, 256)
            if bad:
                raise module_error(
                    record.module,
                    "its output gradient does not come from the extended loss(es) alone: the "
                    "backpropagated objective has other terms (a regulariser on activations, "
                    "a loss that is not extended, a term of the parameters), whose curvature "
                    "curvopt would miss; backpropagate only sums of extended losses inside "
                    "collect, or add the other terms' curvature yourself",
                )

    # ------------------------------------------------------------ sum_n g_n == p.grad
    def add_total(self, p, use, total) -> None:
        """Add one call's ``sum_n g_n`` (``use``: its ``(rule, call, name)``)."""
        old = self.totals.get(id(p))
        if old is None:
            self.totals[id(p)] = [use], total
        else:
            old[0].append(use)
            self.totals[id(p)] = old[0], old[1] + total
        if id(p) in self.param_grads:  # the parameter's hook ran first (dependent outputs)
            self.check_sum(p)

    def parameter_grad(self, p, grad) -> None:
        """``p``'s whole gradient of this pass, checked against the sum of its per-sample
        gradients if those are in already."""
        self.param_grads[id(p)] = (p, grad)
        if id(p) in self.totals:
            self.check_sum(p)

    def check_sum(self, p) -> None:
        """``sum_n g_n == grad`` to the cheap bound, or else noted for the rounding bound."""
        grad = dense(self.param_grads[id(p)][1])
        uses, total = self.totals.pop(id(p))
        if not mismatch(total, grad, 64, self.compute_eps.get(id(p), 0.0)):
            return
        magnitude = sum(
            reduce_in_chunks(rule, call, name, p.shape, {"abs_sum": True})["abs_sum"]
            for rule, call, name in uses
        )
        self.suspects.append((p, total, grad, magnitude))

    def check_materialised(self, batch_grads) -> None:
        """Spot check of ``sum_n g_n == grad`` on evenly spread entries of materialised
        per-sample gradients (``batch_grads``: ``id(p) -> (p, [N, *p.shape])``)."""
        for key, (p, grad) in self.param_grads.items():
            if key not in batch_grads:
                continue
            per_sample = batch_grads[key][1]
            batch = probe_columns(per_sample.reshape(len(per_sample), -1))  # 0-dim p: [N, 1]
            grad = probe_columns(dense(grad).reshape(1, -1))[0]
            total = batch.sum(0)
            if mismatch(total, grad, 64, self.compute_eps.get(key, 0.0)):
                self.suspects.append((p, total, grad, batch.abs().sum(0)))

    def check_suspects(self) -> None:
        """Sums that missed the cheap bound, against the rounding bound (rounding inside each
        ``g_n`` when a parameter's gradient cancels to nearly zero); raises on a real gap."""
        if not self.suspects:
            return
        largest = max(
            float(dense(g).abs().max()) for _, g in self.param_grads.values() if g.numel()
        )
        for p, total, grad, magnitude in self.suspects:
            eps = roundoff(total, grad, floor=self.compute_eps.get(id(p), 0.0))
            tol = 8 * eps * (magnitude + grad.abs()) + 1000 * eps * largest
            if bool(((total - grad.to(total.dtype)).abs() > tol).any()):
                raise UnsupportedModuleError(
                    f"curvopt: parameter {name_of(p)!r} receives gradient from outside the module "
                    "that owns it (used functionally, e.g. a tied output layer "
                    "'h @ embedding.weight.T', or a penalty on the parameter added to the loss); "
                    "per-sample quantities and curvature cannot see that use. Use the parameter "
                    "only through its module (e.g. an nn.Linear sharing the weight) and keep "
                    "penalties on parameters out of the backward pass inside collect"
                )

    def check_seen(self) -> None:
        """Every parameter with a gradient was seen through a call of its module (and the sums
        still open are checked)."""
        for key, (p, _) in self.param_grads.items():
            if key not in self.seen:
                raise UnsupportedModuleError(
                    f"curvopt: parameter {name_of(p)!r} received a gradient, but its module was "
                    "never called in this pass (the parameter is used functionally, e.g. "
                    "F.linear(h, layer.weight)); curvopt sees parameters only through their "
                    "module's forward: call the module instead"
                )
        for key in list(self.totals):
            if key in self.param_grads:
                self.check_sum(self.param_grads[key][0])

    def check_complete(self, results, attrs) -> None:
        """Every parameter that received a gradient gets every requested curvature attribute."""
        for p, _ in self.param_grads.values():
            missing = results.missing(p, attrs)
            if missing:
                raise UnsupportedModuleError(
                    f"curvopt: parameter {name_of(p)!r} received "
                    f"a gradient but no {', '.join(sorted(missing))}: the columns of the "
                    "extended loss do not reach its module's output (the parameter's gradient "
                    "comes from another term of the objective)"
                )

    def clear(self) -> None:
        self.param_grads.clear()
