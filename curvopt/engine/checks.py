"""The checks of one backward pass, each raising before anything is written, and the one
tolerance policy they share.

* every parameter that received a gradient was seen through its module's call;
* the per-sample gradients of each parameter sum to its gradient (a parameter also used
  outside its module, e.g. a tied head ``h @ emb.weight.T``, breaks this);
* for curvature, the gradient flowing into the graph upstream of the extended losses enters
  through them alone (nothing from other terms of the objective: ``watch_flow``, on every
  pass), and every parameter with a gradient gets every requested curvature attribute.

The flow check costs no propagated column. The graph upstream of each extended loss is known
(the pass's ``walk.Walk``); at every node of it that lies downstream of what curvopt reads
(a module call's output, an extended parameter), the gradient the autograd engine hands the
node must be the sum of what the node's consumers inside that graph sent it. A node with one
such consumer receives the very tensor it sent unless something else adds to it (an identity
test, no arithmetic); anything else is compared by value, so that a term whose weight is 0 on
this pass passes and the same term with weight 0.3 on the next raises. The per-sample sums of
a curvature-only pass are checked on the first pass of each graph structure (its
``graph_plan.Plan.sums_checked``): with the flow checked on every pass,
what a sum check adds (a parameter used again inside the losses' graph, a rule that disagrees
with autograd) is a property of the structure.

Tolerance: a comparison of ``a`` with ``b`` fails beyond ``factor * eps * max(|a|, |b|)``, with
``eps`` the unit roundoff of the least precise dtype involved, or of the computation that made
them (an autocast call computes in a lower precision than its parameters: ``note_precision``).
The sum check has two tiers: the cheap bound above (``factor`` 64), then, for the sums that
miss it, the rounding bound ``8 eps (sum_n |g_n| + |grad|) + 1000 eps max |grad of the pass|``.

Projected sums (Freivalds): where a rule computes ``sum_n g_n = sum_r b_r a_rᵀ`` from per-row
factors (``LayerRule.projected_sum``), the sum is checked through ``K = 8`` pairs of Gaussian
probes ``u_k, v_k`` (a generator of the checks' own: the user's random stream is untouched),
``uᵀ (sum_n g_n) v = sum_r (b_rᵀ u)(a_rᵀ v)`` against ``uᵀ grad v``, at ``O(R (I + O) K)`` plus
one read of ``grad`` instead of the ``O(R I O)`` product. Bound: ``64 eps M`` with
``M = sum_r |b_r| |a_r|`` (Euclidean norms). For random probes the rounding of either side,
``uᵀ D v`` for an error matrix ``D``, has standard deviation ``|D|_F``, and ``|D|_F`` is a few
``eps`` times ``|sum_r |b_r| |a_r|ᵀ|_F <= M`` (measured on 2C2D, 3C3D and a 512 x 256 layer
with 1024 rows in float32: at most ``3 eps M``); ``M`` sums norms, so a gradient that cancels
to nearly zero keeps its bound. A wrong sum, ``E = sum_n g_n - grad != 0``, is missed only if
``|u_kᵀ E v_k| <= 64 eps M`` for every ``k``: ``u_kᵀ E v_k = 0`` has probability 0, and with
``r = sigma_max(E) / (64 eps M)`` one probe misses with probability at most
``(2/pi)(2 + ln r) / r`` (given ``v``, ``uᵀ(E v)`` is normal with standard deviation
``|E v| >= sigma_max(E) |z|``, ``z`` standard normal), all eight at most its eighth power:
``2e-3`` for ``r = 5``, ``3e-5`` for ``r = 10``, ``1e-11`` for ``r = 100``. In float32
(``64 eps = 8e-6``) an error of ``sigma_max(E) >= 8e-5 M`` is caught but for ``3e-5``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Optional, Tuple

import torch

from curvopt.engine.checkpointing import segment_on
from curvopt.errors import UnsupportedModuleError, module_error
from curvopt.engine.graph_plan import mark_sums_checked, search
from curvopt.engine.reducer import reduce_in_chunks
from curvopt.engine.reductions import probe_columns
from curvopt.engine.results import name_of
from curvopt.engine.torch_internals import ACCUMULATE_GRAD

_OUTSIDE = (
    "the backpropagated objective has other terms (a regulariser on activations, a loss that "
    "is not extended, a term of the parameters), whose curvature curvopt would miss; "
    "backpropagate only sums of extended losses inside collect, or add the other terms' "
    "curvature yourself"
)


#: probe pairs of the projected sum check
PROBES = 8
#: the projected sums' rounding bound, ``factor * eps * sum_r |b_r| |a_r|``
PROJECTED_FACTOR = 64
#: the checks' own random streams (per device), so that the probes leave the user's untouched
_GENERATORS: Dict[torch.device, torch.Generator] = {}


def draw_probes(p) -> Tuple[torch.Tensor, torch.Tensor]:
    """Gaussian ``u [p.shape[0], K]`` and ``v [p[0].numel(), K]`` for the projected check."""
    gen = _GENERATORS.get(p.device)
    if gen is None:
        gen = _GENERATORS[p.device] = torch.Generator(device=p.device).manual_seed(0x5EED)
    dtype = p.dtype if p.is_floating_point() else torch.get_default_dtype()
    u, v = (
        torch.randn(size, PROBES, generator=gen, device=p.device, dtype=dtype)
        for size in (p.shape[0], p[0].numel())
    )
    return u, v


def projection_pays(p) -> bool:
    """Whether the projected check of ``p`` (as a ``rows x cols`` matrix) costs under a sixth
    of the full sum in flops: per row of the factors, ``K (rows + cols)`` against ``rows cols``
    (the projected convolutions run at a lower rate than the weight gradient's; the sixth
    picks the faster check for every weight of 2C2D and 3C3D, ``benchmarks/projected_guard``)."""
    rows, cols = p.shape[0], p[0].numel()
    return 6 * PROBES * (rows + cols) < rows * cols


def project(matrix, u, v) -> torch.Tensor:
    """``[K]``: ``u_kᵀ matrix v_k`` for ``matrix`` of any shape seen as ``[u.shape[0], -1]``."""
    return ((matrix.reshape(u.shape[0], -1).to(v.dtype) @ v) * u).sum(0)


class _Total:
    """One parameter's sums of this pass: full ``sum_n g_n`` and/or projected through
    ``probes``, with the magnitude ``sum_r |b_r| |a_r|`` of the projected part."""

    __slots__ = ("uses", "full", "total", "probes", "projected", "magnitude")

    def __init__(self):
        self.uses: list = []  # (rule, call, name) of every call
        self.full: list = []  # those that gave a full sum
        self.total: Optional[torch.Tensor] = None
        self.probes: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        self.projected: Optional[torch.Tensor] = None
        self.magnitude: Optional[torch.Tensor] = None


def roundoff(*tensors, floor: float = 0.0) -> float:
    """Unit roundoff of the least precise floating dtype among ``tensors``, at least ``floor``."""
    eps = floor
    for t in tensors:
        if t is not None and t.is_floating_point():
            eps = max(eps, torch.finfo(t.dtype).eps)
    return eps


def mismatch(a, b, factor: float, floor: float = 0.0) -> bool:
    """``|a - b|`` beyond ``factor * roundoff(a, b, floor) * max(|a|, |b|)`` somewhere (the
    roundoff of both dtypes; ``b``, the reference, is compared in ``a``'s dtype).

    Non-finite values: where ``b`` is finite everywhere, a non-finite ``a`` (or a difference
    that overflows) is a mismatch, never a pass; where ``b`` itself is not finite there is
    nothing to verify against (the gradient is visibly broken) and it is not one."""
    if not a.numel():
        return False
    eps = roundoff(a, b, floor=floor)
    if b.dtype != a.dtype:
        b = b.to(a.dtype)
    gap = (a - b).abs_().max()  # one fresh difference, its abs in place
    if not bool(gap.isfinite()):  # NaN or inf in a or b, or an overflow
        return bool(b.isfinite().all())
    bound = factor * eps
    # max(|a|, |b|) >= max |b| (and rounding is monotone): within the bound at max |b|, a sum
    # that is right reads one tensor fewer, with one sync; only otherwise is max |a| read
    if bool(gap <= bound * _max_abs(b)):
        return False
    return bool(gap > bound * _max_abs(a, b))


def _max_abs(*tensors) -> torch.Tensor:
    """``max |x|`` over ``tensors`` as ``max(|min x|, |max x|)``: no full-size ``|x|``."""
    return torch.stack([v for t in tensors for v in torch.aminmax(t)]).abs_().max()


def dense(grad: torch.Tensor) -> torch.Tensor:
    """A sparse gradient (``nn.Embedding(sparse=True)``) as the dense tensor it stands for."""
    return grad.coalesce().to_dense() if grad.is_sparse else grad


class Checks:
    """What the checks of one pass have seen so far."""

    def __init__(self):
        self.totals: Dict[int, _Total] = {}  # id(p): its sums of this pass
        self.param_grads: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}  # id(p): p, grad
        self.seen: set = set()  # ids of parameters whose module call was processed
        self.suspects: list = []  # (p, sum_n g_n, grad, sum_n |g_n|) beyond the cheap bound
        #: (p, projected sum_n g_n, projected grad, M, |u|_1 |v|_1), each [K], beyond 16 eps M
        self.projected_suspects: List[tuple] = []
        self.compute_eps: Dict[int, float] = {}  # id(p): roundoff of autocast calls using p
        self.reached: set = set()  # module calls upstream of the extended losses
        self.watched: set = set()  # autograd nodes whose incoming gradient is checked
        self.senders: set = set()  # autograd nodes whose outgoing gradient is recorded
        self.sent: Dict[Tuple[object, int], list] = defaultdict(list)  # (node, nr): gradients
        self.structures: list = []  # keys of the extended losses' graphs (``walk.Walk``)
        self.sums = False  # whether curvature-only passes check their per-sample sums
        self.modules: dict = {}  # autograd node -> the module whose call's output it produced

    def note_precision(self, record, params) -> None:
        """A call computed in a lower precision than its parameters (autocast) makes ``p.grad``
        that precise only: the sum checks use its roundoff."""
        for _, p in params:
            if record.dtype != p.dtype and p.is_floating_point():
                eps = torch.finfo(record.dtype).eps
                self.compute_eps[id(p)] = max(eps, self.compute_eps.get(id(p), 0.0))

    # ------------------------------------------------------------ curvature: gradient flow
    def watch_flow(self, walk, loss_node):
        """Add the graph upstream of one extended loss (``walk``: of its input; ``loss_node``:
        its output's node); returns the nodes newly to check (``check_flow`` before they run)
        and the nodes newly to record (``record_sent`` after they ran): those of the graph that
        lie downstream of a module call's output or an extended parameter, and the loss's own
        nodes between its output and its input."""
        self.reached.update(walk.calls)
        self.structures.append(walk.key)
        self.sums = self.sums or walk.plan is None or not walk.plan.sums_checked
        users = walk.users
        # a re-run reentrant checkpoint takes its re-run outputs (no input index): its node is
        # checked like a call's output, named by its segment (``checkpointing``)
        self.modules.update((c, segment_on(c)) for c in walk.checkpoints)
        for record, edges in walk.calls.items():
            self.modules.update((edge.node, record.module) for _, edge in edges)
        starts = [*self.modules, *(n for n in users if _extended_leaf(n))]
        region = search(starts, lambda node: users.get(node, ()))  # downstream of what is read
        check = [n for n in region if n not in self.watched]
        self.watched.update(check)
        inside = walk.between(loss_node)
        send = [n for n in (*region, *inside) if n not in self.senders]
        self.senders.update(send)
        return check, send

    def record_sent(self, nexts, grads) -> None:
        """The gradients a node sends to the checked nodes upstream (``nexts``: its
        ``next_functions``)."""
        for grad, (fn, nr) in zip(grads, nexts):
            if fn in self.watched and grad is not None:
                self.sent[(fn, nr)].append(grad)

    def check_flow(self, node, grads) -> None:
        """``grads``, handed to ``node`` by the engine, are what its consumers upstream of the
        extended losses sent (the same tensor, or the sum to roundoff)."""
        for nr, grad in enumerate(grads):
            sent = self.sent.pop((node, nr), ())
            if grad is None or (len(sent) == 1 and sent[0] is grad):
                continue
            grad = dense(grad)
            if not sent:
                bad = bool(grad.any())
            else:
                total = dense(sent[0]).to(grad.dtype)
                for other in sent[1:]:
                    total = total + dense(other).to(grad.dtype)
                bad = total.shape != grad.shape or mismatch(total, grad, 256)
            if bad:
                raise _flow_error(node, self.modules.get(node))

    def check_unreached(self, record, grads) -> None:
        """A module call that no extended loss reaches gets no gradient."""
        if record not in self.reached and any(g is not None and bool(g.any()) for g in grads):
            raise module_error(
                record.module,
                f"its output gradient does not come from the extended loss(es) "
                f"alone (none of them depends on it): {_OUTSIDE}",
            )

    def mark_checked(self) -> None:
        """The pass succeeded: its structures had their sums checked (if they were)."""
        if not self.sums:
            return
        for key in self.structures:
            if key is not None:
                mark_sums_checked(key)

    # ------------------------------------------------------------ sum_n g_n == p.grad
    def projects(self, p) -> bool:
        """Whether ``p``'s sum is checked through probes if its rule can (``projection_pays``)."""
        return p.dim() > 1 and projection_pays(p)

    def probes(self, p) -> Tuple[torch.Tensor, torch.Tensor]:
        """The probes of ``p``'s projected check in this pass (the same for all its calls)."""
        entry = self.totals.setdefault(id(p), _Total())
        if entry.probes is None:
            entry.probes = draw_probes(p)
        return entry.probes

    def add_total(self, p, use, total) -> None:
        """Add one call's ``sum_n g_n`` (``use``: its ``(rule, call, name)``)."""
        entry = self.totals.setdefault(id(p), _Total())
        entry.uses.append(use)
        entry.full.append(use)
        entry.total = total if entry.total is None else entry.total + total
        self._check_if_due(p)

    def add_projected(self, p, use, projected, magnitude) -> None:
        """Add one call's ``sum_n g_n`` seen through ``p``'s probes (``self.probes(p)``) and
        its magnitude ``sum_r |b_r| |a_r|`` (``LayerRule.projected_sum``)."""
        entry = self.totals[id(p)]
        entry.uses.append(use)
        if entry.projected is None:
            entry.projected, entry.magnitude = projected, magnitude
        else:
            entry.projected, entry.magnitude = (
                entry.projected + projected,
                entry.magnitude + magnitude,
            )
        self._check_if_due(p)

    def _check_if_due(self, p) -> None:
        if id(p) in self.param_grads:  # the parameter's hook ran first (dependent outputs)
            self.check_sum(p)

    def parameter_grad(self, p, grad) -> None:
        """``p``'s whole gradient of this pass, checked against the sum of its per-sample
        gradients if those are in already."""
        self.param_grads[id(p)] = (p, grad)
        if id(p) in self.totals:
            self.check_sum(p)

    def has_grad(self, p) -> bool:
        """Whether ``p`` received its gradient of this pass."""
        return id(p) in self.param_grads

    def pass_grad(self, p) -> torch.Tensor:
        """``p``'s whole gradient of this pass (dense)."""
        return dense(self.param_grads[id(p)][1])

    def check_sum(self, p) -> None:
        """``sum_n g_n == grad`` to the cheap bound, or else noted for the rounding bound."""
        grad = self.pass_grad(p)
        entry = self.totals.pop(id(p))
        if entry.projected is not None:
            self._check_projected(p, entry, grad)
            return
        if not mismatch(entry.total, grad, 64, self.compute_eps.get(id(p), 0.0)):
            return
        self.suspects.append((p, entry.total, grad, _abs_sum(p, entry.full)))

    def _check_projected(self, p, entry, grad) -> None:
        """The projected sums against ``uᵀ grad v`` to ``64 eps M``, else noted as wrong (a
        call that gave a full sum is projected too, with ``sum_n |g_n|`` for its ``M``)."""
        u, v = entry.probes
        total, magnitude = entry.projected, entry.magnitude
        if entry.total is not None:
            total = total + project(entry.total, u, v)
            magnitude = magnitude + _norm_sum(p, entry.full)
        seen = project(grad, u, v)
        if not bool(seen.isfinite().all()):
            return  # the gradient itself is not finite: nothing to verify against
        eps = roundoff(total, grad, floor=self.compute_eps.get(id(p), 0.0))
        gap = (total - seen.to(total.dtype)).abs_()
        if not bool((gap <= magnitude * (PROJECTED_FACTOR * eps)).all()):  # NaN: not <=
            self.projected_suspects.append((p, total, seen))

    def check_materialised(self, batch_grads) -> None:
        """Spot check of ``sum_n g_n == grad`` on evenly spread entries of materialised
        per-sample gradients (``batch_grads``: ``id(p) -> (p, [N, *p.shape])``)."""
        for key, (p, grad) in self.param_grads.items():
            if key not in batch_grads:
                continue
            per_sample = batch_grads[key][1]
            batch = probe_columns(per_sample.reshape(per_sample.shape[0], -1))  # 0-dim p: [N, 1]
            grad = probe_columns(dense(grad).reshape(1, -1))[0]
            total = batch.sum(0)
            if mismatch(total, grad, 64, self.compute_eps.get(key, 0.0)):
                self.suspects.append((p, total, grad, batch.abs().sum(0)))

    def check_suspects(self) -> None:
        """Sums that missed the cheap bound, against the rounding bound (rounding inside each
        ``g_n`` when a parameter's gradient cancels to nearly zero); raises on a real gap.
        A projected sum beyond its bound (which covers cancellation: ``M`` sums norms) raises."""
        for p, total, seen in self.projected_suspects:
            _raise_wrong_sum(p, (total - seen.to(total.dtype)).abs_())
        if not self.suspects:
            return
        largest = float(_max_abs(*(dense(g) for _, g in self.param_grads.values() if g.numel())))
        for p, total, grad, magnitude in self.suspects:
            gap = (total - grad.to(total.dtype)).abs_()
            eps = roundoff(total, grad, floor=self.compute_eps.get(id(p), 0.0))
            tol = (magnitude + grad.abs()).mul_(8 * eps).add_(1000 * eps * largest)
            if bool((gap > tol).any()) or not bool(gap.isfinite().all()):
                _raise_wrong_sum(p, gap)

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

    def release(self) -> None:
        """Drop the references to the graph's nodes and gradients (the pass has ended)."""
        self.sent.clear()
        self.watched.clear()
        self.senders.clear()
        self.modules.clear()

    def clear(self) -> None:
        self.param_grads.clear()
        self.release()


def _raise_wrong_sum(p, gap) -> None:
    """The error for per-sample results of ``p`` that do not sum to its gradient (``gap``)."""
    if not bool(gap.isfinite().all()):  # mismatch lets these through only for a finite grad
        raise UnsupportedModuleError(
            f"curvopt: the per-sample results for parameter {name_of(p)!r} are not finite "
            "(NaN or inf) where its gradient is: the layer rule of the module that owns it "
            "went wrong on this input. Leave the parameter out (requires_grad=False) and "
            "report the module and input shapes as a curvopt bug"
        )
    raise UnsupportedModuleError(
        f"curvopt: parameter {name_of(p)!r} receives gradient from outside the module "
        "that owns it (used functionally, e.g. a tied output layer "
        "'h @ embedding.weight.T', or a penalty on the parameter added to the loss); "
        "per-sample quantities and curvature cannot see that use. Use the parameter "
        "only through its module (e.g. an nn.Linear sharing the weight) and keep "
        "penalties on parameters out of the backward pass inside collect"
    )


def _norm_sum(p, uses) -> torch.Tensor:
    """``sum_n |g_n|`` (Euclidean) of ``p`` over the calls ``uses``, in chunks."""
    return sum(
        reduce_in_chunks(rule, call, name, p.shape, {"l2": True})["l2"].sqrt().sum()
        for rule, call, name in uses
    )


def _abs_sum(p, uses) -> torch.Tensor:
    """``sum_n |g_n|`` of ``p`` over the calls ``uses``, materialised in chunks."""
    return sum(
        reduce_in_chunks(rule, call, name, p.shape, {"abs_sum": True})["abs_sum"]
        for rule, call, name in uses
    )


def _extended_leaf(node) -> bool:
    """``node`` accumulates into a parameter of an extended module."""
    return type(node).__name__ == ACCUMULATE_GRAD and getattr(
        node.variable, "_curvopt_checked", False
    )


def _flow_error(node, module) -> Exception:
    """The error for gradient from outside the extended losses arriving at ``node`` (the
    output of a call of ``module``, if not None)."""
    if type(node).__name__ == ACCUMULATE_GRAD:
        return UnsupportedModuleError(
            f"curvopt: parameter {name_of(node.variable)!r} receives gradient from outside the "
            "module that owns it and the extended loss(es) (a penalty on the parameter added "
            f"to the loss, or a use outside its module): {_OUTSIDE}"
        )
    if module is not None:
        return module_error(
            module,
            f"its output gradient does not come from the extended loss(es) alone: {_OUTSIDE}",
        )
    return UnsupportedModuleError(
        f"curvopt: the gradient of an intermediate result between the model's modules and the "
        f"extended loss(es) (autograd node {type(node).__name__}) does not come from the "
        f"extended loss(es) alone: {_OUTSIDE}"
    )
