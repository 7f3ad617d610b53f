"""State of one backward pass inside ``collect``: pending results, written when it finishes.

Results are buffered and written as attributes by a callback the autograd engine runs at the
end of the pass, so an exception in the middle leaves no half-written attribute (a reused
result buffer is taken off its parameter while it is being overwritten, see ``buffers``).

Checks that keep the numbers honest, each raising before anything is written:

* every parameter that received a gradient was seen through its module's call;
* the per-sample gradients of each parameter sum to its gradient (a parameter also used
  outside its module, e.g. a tied head ``h @ emb.weight.T``, breaks this), with a tolerance
  from the dtype's precision and the per-sample magnitudes ``sum_n |g_n|``;
* for curvature, each module's output gradient is what the extended losses send it (nothing
  from other terms of the objective), and the loss rows map onto the model's samples
  (``rows``).

The checks run on every pass (a term whose weight is zero on one pass may not be on the next).

Only gradient that is accumulated into ``p.grad`` counts: a pass that does not accumulate into a
parameter (``torch.autograd.grad``, e.g. the input gradient of an adversarial attack, or
``backward(inputs=...)`` without it) writes nothing for it, and a pass that accumulates into
none of the parameters it reaches is ignored altogether (its module inputs stay, so a retained
graph can still be backpropagated).
"""

from __future__ import annotations

import contextlib
from typing import Dict, Optional, Tuple

import torch

from curvopt.buffers import empty_result
from curvopt.curvature import CurvaturePass, check_reduction
from curvopt.errors import (
    MissingLossError,
    UnsupportedLossError,
    UnsupportedModuleError,
    module_error,
)
from curvopt.extensions.quantity import Producer
from curvopt.layers import rule_for
from curvopt.losses import loss_rule_for
from curvopt.params import shared_parameters, trainable
from curvopt.propagate import module_outputs
from curvopt.records import Call
from curvopt.reductions import probe_columns, squared_norms, sum_of_squares
from curvopt.results import ResultBuffer, name_of
from curvopt.rows import establish
from curvopt.torch_internals import current_autograd_node, queue_callback, will_engine_execute_node

#: elements per chunk when per-sample gradients are materialised only to be reduced
_CHUNK_ELEMENTS = 1 << 21

#: first-order producers computed from the per-sample gradients without keeping them
_REDUCED = (Producer.SQUARED_NORMS, Producer.SUM_OF_SQUARES, Producer.MOMENTS)


def _eps(*tensors) -> float:
    """Unit roundoff of the least precise floating dtype among ``tensors``."""
    return max(torch.finfo(t.dtype).eps for t in tensors if t is not None and t.is_floating_point())


_NO_OP = contextlib.nullcontext()


def _autocast_off() -> contextlib.AbstractContextManager:
    """Autocast disabled while curvopt computes (a backward pass run inside ``autocast`` would
    otherwise compute the quantities in whatever dtype each op's autocast policy picks)."""
    if not (torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")):
        return _NO_OP
    stack = contextlib.ExitStack()
    for device in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device):
            stack.enter_context(torch.autocast(device, enabled=False))
    return stack


class BackwardPass:
    """Per-pass buffers; ``on_module`` is called by every extended module's gradient hook."""

    def __init__(self, extensions, task: int, accumulator, skipped=None, diagonal=False):
        self.task = task
        #: ``collect(skip_unsupported=...)``: where to report the parameters left out (the
        #: result buffer does), and whether they get the diagonal of the curvature instead
        self.results = ResultBuffer(skipped)
        self.skip_diagonal = diagonal
        self.extensions = extensions
        self.accumulator = accumulator
        #: first-order producer -> the attributes it writes (from each quantity's declaration)
        self.first: Dict[Producer, list] = {}
        for ext in extensions:
            if ext.order == 1:
                self.first.setdefault(ext.quantity.producer, []).append(ext.attr)
        self.second_order_exts = [ext for ext in extensions if ext.order == 2]
        self.loss_seen = False
        self.batch_size: Optional[int] = None
        self.reused: Dict[int, bool] = {}
        self.shared: Optional[set] = None
        self.totals: Dict[int, Tuple[object, object, torch.Tensor]] = {}  # id(p): rule, call, sum
        self.param_grads: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}  # id(p): p, grad
        self.seen: set = set()  # ids of parameters whose module call was processed
        self.suspects: list = []  # (p, sum_n g_n, grad, sum_n |g_n|) beyond the cheap bound
        self.compute_eps: Dict[int, float] = {}  # id(p): roundoff of autocast calls using p
        self.expected: Dict[object, list] = {}  # record: the extended losses' output gradients
        self.batch_grads: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}  # id(p): p, [N, *p]
        self.handles: list = []  # hooks on autograd nodes, removed when the pass ends
        self.upstream: list = []  # module calls upstream of the extended losses
        self.failed = False
        self.searched = False  # the graph upstream was searched for broadcast calls
        self.ignored = False  # the pass accumulates into no parameter it reaches
        self.untouched: Dict[int, bool] = {}  # id(p): the pass does not accumulate into p.grad
        self.reached: set = set()  # autograd nodes whose upstream ``_reaches`` has walked
        queue_callback(self._finish)

    def _skips(self, p) -> bool:
        """Whether this pass leaves ``p.grad`` alone (``torch.autograd.grad``, ``backward(inputs=
        ...)`` without ``p``): ``p``'s gradient accumulator is in the graph, but the engine will
        not run it. (A parameter outside the graph, unused in this pass, is not skipped: it gets
        zeros, as its module's output gradient says.)"""
        key = id(p)
        skip = self.untouched.get(key)
        if skip is None:
            with torch.enable_grad():
                accumulator = p.view_as(p).grad_fn.next_functions[0][0]
            try:
                skip = not will_engine_execute_node(accumulator) and self._reaches(accumulator)
            except RuntimeError:  # p is an input of torch.autograd.grad
                skip = True
            self.untouched[key] = skip
        return skip

    def _reaches(self, node) -> bool:
        """Whether ``node`` lies upstream of the autograd node running now (the graph is walked
        once per pass, incrementally: a node seen before had its whole upstream walked)."""
        stack = [current_autograd_node()]
        while stack:
            current = stack.pop()
            if current is None or current in self.reached:
                continue
            self.reached.add(current)
            stack.extend(fn for fn, _ in current.next_functions)
        return node in self.reached

    def _skips_all(self, modules) -> bool:
        """The pass accumulates into none of the trainable parameters of ``modules`` (and there
        is one)."""
        skips = [self._skips(p) for m in modules for _, p in trainable(m)]
        return bool(skips) and all(skips)

    # ---------------------------------------------------------------- hooks
    def on_loss(self, record, grad) -> bool:
        """The gradient reached an extended loss: check it, then compute all curvature. False
        where the pass is ignored (the loss's record stays for another pass)."""
        if self.failed:
            return True
        if self.ignored:
            return False
        try:
            check_reduction(record.module)
            if not (self.second_order_exts or self.first):
                return True
            upstream = module_outputs(record.output)
            if not upstream.calls and upstream.foreign:
                raise UnsupportedModuleError(
                    f"curvopt: the input of the extended loss {type(record.module).__name__} "
                    f"depends on parameters (one of shape {tuple(upstream.foreign[0].shape)}) "
                    "of modules that were not extended, "
                    "so curvopt cannot compute anything for them; extend the model too: "
                    "model = curvopt.extend(model)"
                )
            if self._skips_all(r.module for r in upstream.calls):
                self.ignored = True
                return False
            if upstream.reentrant and self.second_order_exts:
                raise UnsupportedModuleError(
                    "curvopt cannot propagate curvature through "
                    "torch.utils.checkpoint(..., use_reentrant=True): the checkpointed segment "
                    "is rebuilt inside its own backward, out of reach of the loss's columns; "
                    "use torch.utils.checkpoint(..., use_reentrant=False) (first-order "
                    "quantities work with either)"
                )
            self.loss_seen = True
            with _autocast_off():
                if self.second_order_exts:
                    cpass = CurvaturePass(self, record, grad)
                    cpass.run(upstream)
                    self.batch_size = self.batch_size or cpass.layout.samples
                else:
                    self._check_layout(record, upstream)
        except BaseException:
            self._abort()
            raise
        return True

    def _check_layout(self, record, upstream) -> None:
        """First order under an extended loss: the loss rows map onto the model's samples
        (catches ops that mix samples; probes run once per graph structure, see ``rows``, and on
        every pass where the model indexes by data)."""
        try:
            elementwise = loss_rule_for(record.module).elementwise
        except UnsupportedLossError:
            return  # a loss without a curvature rule still gets first-order quantities
        self.watch_broadcasts(upstream.calls)
        # not for logits[mask] & co: the rows need not map onto samples as the shapes suggest;
        # an index inside the model (mixup by h[perm]) is probed, on every pass
        # (not through a reentrant checkpoint, which refuses torch.autograd.grad)
        probe = upstream.signature is not None or upstream.indexes_inside
        if upstream.calls and probe and not upstream.reentrant:
            output = record.output
            establish(
                output,
                output.shape,
                upstream.calls,
                upstream.batchable,
                upstream.signature,
                elementwise,
                required=False,
            )

    def watch_broadcasts(self, calls) -> None:
        """Read the per-sample output gradients of broadcast calls where they still exist (and
        remember the calls upstream of the loss, to release them if the pass fails)."""
        self.upstream.extend(calls)
        for record in calls:
            broadcast = record.broadcast
            if broadcast is not None:

                def keep(grad_outputs, broadcast=broadcast):
                    broadcast.grad = broadcast.per_sample(grad_outputs[0][None])[0]

                self.handles.append(broadcast.edge.node.register_prehook(keep))

    def _watch_upstream(self, record) -> None:
        """First order without an extended loss (Hugging Face's ``labels=`` loss): at the first
        module hook, find the broadcast calls upstream of the node now running (the one that
        produced ``record``'s output), whose per-sample gradients still exist downstream."""
        self.searched = True
        node = current_autograd_node()
        if node is None:
            return
        calls = module_outputs(node).calls
        if record in calls:
            record.broadcast = None  # its gradient has arrived already, summed or not
        self.watch_broadcasts([r for r in calls if r is not record])

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

    def on_module(self, record, grads) -> bool:
        """One module call's output gradient. False where the pass leaves the call alone (it
        accumulates into none of its parameters): its record stays for another pass."""
        if self.failed:
            return True
        if self.ignored or self._skips_all((record.module,)):
            return False
        try:
            with _autocast_off():
                self._on_module(record, grads)
        except BaseException:
            self._abort()
            raise
        return True

    def _on_module(self, record, grads) -> None:
        module = record.module
        if not self.searched and not self.loss_seen and self.first:
            self._watch_upstream(record)
        if record.broadcast is not None:
            grads = (record.broadcast.grad,)  # per sample, read downstream of the broadcast
        grads = tuple(record.batch_first(g) for g in grads)
        if len(grads) > 1 and grads[0] is None:  # the batch size is read from the first output
            zeros = torch.zeros(record.out_shapes[0], dtype=record.dtype, device=record.device)
            grads = (zeros, *grads[1:])
        if self.second_order_exts:
            if not self.loss_seen:
                names = ", ".join(repr(e) for e in self.second_order_exts)
                raise MissingLossError(
                    f"{names} need(s) the loss: the loss that was backpropagated was not "
                    "computed by an extended loss module; wrap it, e.g. "
                    "lossfunc = curvopt.extend(torch.nn.CrossEntropyLoss())"
                )
            self._check_expected(record, grads)
        elif not self.first:
            return
        rule = rule_for(module)
        reason = rule.check(module)
        if reason is not None:
            raise module_error(module, reason)
        grad_out = grads[0] if len(grads) == 1 else grads
        call = record.call(grad_out)
        params = [(name, p) for name, p in trainable(module) if not self._skips(p)]
        self._note_precision(record, params)
        self.seen.update(id(p) for _, p in params)
        if not self.first:
            for name, p in params:
                self._add_total(p, rule, call, name, rule.grad_sum(call, name))
            return
        self._check_batch_size(call)
        if self.shared is None:
            self.shared = shared_parameters()
        key = id(module)
        if key not in self.reused:
            self.reused[key] = module._curvopt_live > 1 or any(
                id(p) in self.shared for _, p in params
            )
        materialise = Producer.PER_SAMPLE_GRADIENTS in self.first or self.reused[key]
        for name, p in params:
            if materialise:
                self._accumulate(p, rule, call, name)
            else:
                self._reduce(p, rule, call, name)

    def _note_precision(self, record, params) -> None:
        """A call computed in a lower precision than its parameters (autocast) makes ``p.grad``
        that precise only: the sum checks use its roundoff."""
        for _, p in params:
            if record.dtype != p.dtype and p.is_floating_point():
                eps = torch.finfo(record.dtype).eps
                self.compute_eps[id(p)] = max(eps, self.compute_eps.get(id(p), 0.0))

    def _check_expected(self, record, grads) -> None:
        """The module's output gradients must come from the extended losses alone."""
        expected = self.expected.get(record)
        for index, grad in enumerate(grads):
            if grad is None:
                continue
            want = None if expected is None else expected[index]
            if want is None:
                bad = grad.any()
            else:
                scale = torch.maximum(grad.abs().max(), want.abs().max())
                bad = (grad - want).abs().max() > 256 * _eps(grad, want) * scale
            if bool(bad):  # one sync
                raise module_error(
                    record.module,
                    "its output gradient does not come from the extended loss(es) alone: the "
                    "backpropagated objective has other terms (a regulariser on activations, "
                    "a loss that is not extended, a term of the parameters), whose curvature "
                    "curvopt would miss; backpropagate only sums of extended losses inside "
                    "collect, or add the other terms' curvature yourself",
                )

    def _check_batch_size(self, call: Call) -> None:
        n = call.batch_size
        if self.batch_size is None:
            self.batch_size = n
        elif n != self.batch_size:
            raise module_error(
                call.module,
                f"it sees {n} samples along dim {call.batch_dim} while other modules saw "
                f"{self.batch_size}; per-sample quantities need the batch dimension kept intact "
                "(do not fold other dims into it before a layer with parameters; sequence-first "
                "models: extend the loss module too, so that curvopt can find the batch, declare "
                "curvopt.extend(model, sequence_first=True), or use batch_first=True; a module "
                "called without the batch whose output is added to every sample, such as "
                "position embeddings of a shared arange(T): "
                "extend the loss module too, curvopt.extend(lossfunc), so that curvopt can "
                "follow the broadcast, or index them per sample, "
                "pos_emb(torch.arange(T).expand(N, T)))",
            )

    def _accumulate(self, p, rule, call, name) -> None:
        """Add this call's per-sample gradients into ``[N, *p.shape]``."""
        shape = (call.batch_size, *p.shape)
        like = call.first_grad
        if id(p) not in self.batch_grads:
            kept = self.first.get(Producer.PER_SAMPLE_GRADIENTS)
            if kept:
                buffer = empty_result(p, kept[0], shape, like)
            else:
                buffer = torch.empty(shape, dtype=like.dtype, device=like.device)
            self.batch_grads[id(p)] = (p, rule.batch_grad(call, name, out=buffer))
        else:
            self.batch_grads[id(p)][1].add_(rule.batch_grad(call, name))

    def _reduce(self, p, rule, call, name) -> None:
        """Reduced quantities of a parameter used once, via fast paths where the rule has them."""
        first = self.first
        want_l2 = Producer.SQUARED_NORMS in first
        want_sgs = Producer.SUM_OF_SQUARES in first or Producer.MOMENTS in first
        l2 = rule.batch_l2(call, name) if want_l2 else None
        sgs = rule.sum_grad_squared(call, name) if want_sgs else None
        total = rule.grad_sum(call, name)  # also checked against p's whole gradient
        missing = {
            "l2": want_l2 and l2 is None,
            "sgs": want_sgs and sgs is None,
            "grad_sum": Producer.MOMENTS in first and total is None,
        }
        if any(missing.values()):
            chunked = _reduce_in_chunks(rule, call, name, p.shape, missing)
            l2 = chunked.get("l2", l2)
            sgs = chunked.get("sgs", sgs)
            total = chunked.get("grad_sum", total)
        self._add_total(p, rule, call, name, total)
        self._store(p, l2, sgs, total)

    def _add_total(self, p, rule, call, name, total) -> None:
        """Add this call's ``sum_n g_n`` (computed in chunks if the rule has no fast path)."""
        if total is None:
            total = _reduce_in_chunks(rule, call, name, p.shape, {"grad_sum": True})["grad_sum"]
        old = self.totals.get(id(p))
        if old is None:
            self.totals[id(p)] = [(rule, call, name)], total
        else:
            old[0].append((rule, call, name))
            self.totals[id(p)] = old[0], old[1] + total
        if id(p) in self.param_grads:  # the parameter's hook ran first (dependent outputs)
            self._check_sum(p)

    def on_parameter_grad(self, p, grad: torch.Tensor) -> None:
        """``p``'s whole gradient of this pass. Its hook normally runs after those of all the
        module calls using ``p`` (a module whose outputs depend on each other is the
        exception), so the sum of per-sample gradients is checked at whichever comes last."""
        if self.failed or self.ignored or not (self.first or self.second_order_exts):
            return
        if self._skips(p):
            return
        self.param_grads[id(p)] = (p, grad)
        if id(p) in self.totals:
            self._checked(self._check_sum, p)

    def _checked(self, check, *args) -> None:
        try:
            check(*args)
        except BaseException:
            self._abort()
            raise

    def _check_sum(self, p) -> None:
        """``sum_n g_n == grad``: a mismatch beyond the cheap bound
        ``|sum - grad| <= 64 eps max(|sum|, |grad|)`` is measured against the rounding bound
        ``8 eps (sum_n |g_n| + |grad|)`` before it raises."""
        grad = _dense(self.param_grads[id(p)][1])
        uses, total = self.totals.pop(id(p))
        if not _off(total, grad, 64, self.compute_eps.get(id(p), 0.0)):
            return
        magnitude = sum(
            _reduce_in_chunks(rule, call, name, p.shape, {"abs_sum": True})["abs_sum"]
            for rule, call, name in uses
        )
        self.suspects.append((p, total, grad, magnitude))

    def _check_suspects(self) -> None:
        """Sums that missed the cheap bound, against ``8 eps (sum_n |g_n| + |grad|)`` plus
        ``1000 eps`` times the largest gradient entry of the pass (rounding inside each
        ``g_n`` when a parameter's gradient cancels to nearly zero); raises on a real gap."""
        if not self.suspects:
            return
        largest = max(
            float(_dense(g).abs().max()) for _, g in self.param_grads.values() if g.numel()
        )
        for p, total, grad, magnitude in self.suspects:
            eps = max(_eps(total, grad), self.compute_eps.get(id(p), 0.0))
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

    def _check_seen(self) -> None:
        """Every parameter with a gradient was seen through a call of its module."""
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
                self._check_sum(self.param_grads[key][0])

    def _check_materialised(self) -> None:
        """Spot check of ``sum_n g_n == grad`` on evenly spread entries of materialised
        per-sample gradients (see :meth:`_check_sum`)."""
        for key, (p, grad) in self.param_grads.items():
            if key not in self.batch_grads:
                continue
            per_sample = self.batch_grads[key][1]
            batch = probe_columns(per_sample.reshape(len(per_sample), -1))  # 0-dim p: [N, 1]
            grad = probe_columns(_dense(grad).reshape(1, -1))[0]
            total = batch.sum(0)
            if _off(total, grad, 64, self.compute_eps.get(key, 0.0)):
                self.suspects.append((p, total, grad, batch.abs().sum(0)))

    def _store(self, p, l2, sgs, total) -> None:
        """The reduced first-order results of ``p``, each for the attributes its producer
        writes (``MOMENTS``: ``(sum g^2, sum g)``, turned into a variance by ``accumulate``)."""
        for producer, value in (
            (Producer.SQUARED_NORMS, l2),
            (Producer.SUM_OF_SQUARES, sgs),
            (Producer.MOMENTS, (sgs, total)),
        ):
            self._put_all(p, producer, value)

    def _put_all(self, p, producer, value) -> None:
        """``value`` for every attribute ``producer`` writes (copies beyond the first)."""
        for i, attr in enumerate(self.first.get(producer, ())):
            self.results.put(p, attr, value if i == 0 else _copy(value))

    # ---------------------------------------------------------------- end of pass
    def _finish(self) -> None:
        with _autocast_off():
            self._finish_pass()

    def _finish_pass(self) -> None:
        for handle in self.handles:
            handle.remove()
        if self.failed:
            return
        try:
            self._check_seen()
            self._check_materialised()
            self._check_suspects()
            self._check_complete()
        except BaseException:
            self._abort()
            raise
        for p, batch in self.batch_grads.values():
            self._put_all(p, Producer.PER_SAMPLE_GRADIENTS, batch)
            first = self.first
            if any(producer in first for producer in _REDUCED):
                l2 = squared_norms(batch) if Producer.SQUARED_NORMS in first else None
                want_sgs = Producer.SUM_OF_SQUARES in first or Producer.MOMENTS in first
                sgs = sum_of_squares(batch) if want_sgs else None
                total = batch.sum(0) if Producer.MOMENTS in first else None
                self._store(p, l2, sgs, total)
        self.results.write(self.accumulator, self.batch_size or 0, self.untouched)
        self.batch_grads.clear()

    def _check_complete(self) -> None:
        """Every parameter that received a gradient gets every requested curvature attribute."""
        attrs = {ext.attr for ext in self.second_order_exts}
        for p, _ in self.param_grads.values():
            missing = self.results.missing(p, attrs)
            if missing:
                raise UnsupportedModuleError(
                    f"curvopt: parameter {name_of(p)!r} received "
                    f"a gradient but no {', '.join(sorted(missing))}: the columns of the "
                    "extended loss do not reach its module's output (the parameter's gradient "
                    "comes from another term of the objective)"
                )

    def _abort(self) -> None:
        """Forget everything written so far; the pass writes nothing. The calls whose hooks will
        not run now drop their inputs (an exception's traceback may keep the graph alive)."""
        self.failed = True
        for record in self.upstream:
            record.release()
        for handle in self.handles:
            handle.remove()
        self.batch_grads.clear()
        self.results.clear()
        self.param_grads.clear()


def _dense(grad: torch.Tensor) -> torch.Tensor:
    """A sparse gradient (``nn.Embedding(sparse=True)``) as the dense tensor it stands for."""
    return grad.coalesce().to_dense() if grad.is_sparse else grad


def _off(total, grad, factor: float, eps: float = 0.0) -> bool:
    """``|total - grad|`` beyond ``factor * eps * max(|total|, |grad|)`` somewhere (``eps`` at
    least the roundoff of their dtypes)."""
    if not total.numel():
        return False
    grad = grad.to(total.dtype)
    scale = torch.maximum(total.abs().max(), grad.abs().max())
    eps = max(eps, _eps(total, grad))
    return bool((total - grad).abs().max() > factor * eps * scale)  # one sync


def _copy(value):
    """A copy of a result (a tensor or a tuple of them), so that two attributes never alias."""
    return tuple(v.clone() for v in value) if isinstance(value, tuple) else value.clone()


def _reduce_in_chunks(rule, call, name, shape, want):
    """The ``want``-ed of ``l2`` (``||g_n||^2``, ``[N]``), ``sgs`` (``sum_n g_n**2``),
    ``grad_sum`` and ``abs_sum`` (``sum_n |g_n|``, ``p.shape``) from per-sample gradients,
    materialised chunk by chunk."""
    n = call.batch_size
    step = max(1, _CHUNK_ELEMENTS // max(1, torch.Size(shape).numel()))
    parts = {key: [] for key, wanted in want.items() if wanted}
    for start in range(0, n, step):
        chunk = rule.batch_grad(call.slice(start, min(n, start + step)), name)
        if "l2" in parts:
            parts["l2"].append(squared_norms(chunk))
        if "sgs" in parts:
            parts["sgs"].append(sum_of_squares(chunk))
        if "grad_sum" in parts:
            parts["grad_sum"].append(chunk.sum(0))
        if "abs_sum" in parts:
            parts["abs_sum"].append(chunk.abs().sum(0))
    return {
        key: torch.cat(values) if key == "l2" else torch.stack(values).sum(0)
        for key, values in parts.items()
    }
