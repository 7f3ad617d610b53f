"""State of one backward pass inside ``collect``: pending results, written when it finishes.

Results are buffered and written as attributes by a callback the autograd engine runs at the
end of the pass, so an exception in the middle leaves no half-written attribute (a reused
result buffer is taken off its parameter while it is being overwritten, see ``buffers``).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch.autograd import Variable

from curvopt.buffers import empty_result
from curvopt.errors import MissingLossError, UnsupportedModuleError
from curvopt.hooks import shared_parameters, trainable
from curvopt.layers import rule_for
from curvopt.records import Call
from curvopt.reductions import probe_spans, squared_norms, sum_of_squares

#: elements per chunk when per-sample gradients are materialised only to be reduced
_CHUNK_ELEMENTS = 1 << 21

_REDUCED = ("batch_l2", "sum_grad_squared", "variance")


def module_error(module, reason: str) -> UnsupportedModuleError:
    return UnsupportedModuleError(
        f"curvopt cannot compute this for module {module._curvopt_path!r} "
        f"({type(module).__name__}): {reason}"
    )


class BackwardPass:
    """Per-pass buffers; ``on_module`` is called by every extended module's gradient hook."""

    def __init__(self, extensions, task: int):
        self.task = task
        self.extensions = extensions
        self.attrs = {ext.attr for ext in extensions if ext.order == 1}
        self.second_order_exts = [ext for ext in extensions if ext.order == 2]
        self.loss_seen = False
        self.batch_size: Optional[int] = None
        self.reused: Dict[int, bool] = {}
        self.shared: Optional[set] = None
        self.totals: Dict[int, torch.Tensor] = {}  # id(p): sum_n g_n, where computed
        self.param_grads: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}  # id(p): p, grad
        self.kron_owner: Dict[Tuple[int, str], object] = {}  # (id(p), attr): module call
        self.batch_grads: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}  # id(p): p, [N, *p]
        self.results: Dict[Tuple[int, str], Tuple[torch.Tensor, torch.Tensor]] = {}
        self.failed = False
        Variable._execution_engine.queue_callback(self._finish)

    # ---------------------------------------------------------------- hooks
    def on_loss(self, record, grad) -> None:
        """The gradient reached an extended loss: check it, then compute all curvature."""
        if self.failed:
            return
        try:
            from curvopt.second_order import CurvaturePass, check_reduction

            check_reduction(record.module)
            self.loss_seen = True
            if self.second_order_exts:
                CurvaturePass(self, record, grad).run()
        except BaseException:
            self._abort()
            raise

    def on_module(self, record, grads) -> None:
        if self.failed:
            return
        try:
            self._on_module(record, grads)
        except BaseException:
            self._abort()
            raise

    def _on_module(self, record, grads) -> None:
        module = record.module
        if self.second_order_exts and not self.loss_seen:
            names = ", ".join(repr(e) for e in self.second_order_exts)
            raise MissingLossError(
                f"{names} need(s) the loss: the loss that was backpropagated was not computed "
                "by an extended loss module; wrap it, e.g. "
                "lossfunc = curvopt.extend(torch.nn.CrossEntropyLoss())"
            )
        if not self.attrs:
            return
        rule = rule_for(module)
        reason = rule.check(module)
        if reason is not None:
            raise module_error(module, reason)
        grad_out = grads[0] if len(grads) == 1 else grads
        call = Call(module, record.args, record.kwargs, grad_out, rule.batch_dim(module))
        self._check_batch_size(call)
        params = trainable(module)
        if self.shared is None:
            self.shared = shared_parameters()
        key = id(module)
        if key not in self.reused:
            self.reused[key] = module._curvopt_live > 1 or any(
                id(p) in self.shared for _, p in params
            )
        materialise = "grad_batch" in self.attrs or self.reused[key]
        for name, p in params:
            if materialise:
                self._accumulate(p, rule, call, name)
            else:
                self._reduce(p, rule, call, name)

    def _check_batch_size(self, call: Call) -> None:
        n = call.batch_size
        if self.batch_size is None:
            self.batch_size = n
        elif n != self.batch_size:
            raise module_error(
                call.module,
                f"it sees {n} samples along dim {call.batch_dim} while other modules saw "
                f"{self.batch_size}; per-sample quantities need the batch dimension kept intact "
                "(do not fold other dims into it before a layer with parameters)",
            )

    def _accumulate(self, p, rule, call, name) -> None:
        """Add this call's per-sample gradients into ``[N, *p.shape]``."""
        shape = (call.batch_size, *p.shape)
        like = call.first_grad
        if id(p) not in self.batch_grads:
            if "grad_batch" in self.attrs:
                buffer = empty_result(p, "grad_batch", shape, like)
            else:
                buffer = torch.empty(shape, dtype=like.dtype, device=like.device)
            self.batch_grads[id(p)] = (p, rule.batch_grad(call, name, out=buffer))
        else:
            self.batch_grads[id(p)][1].add_(rule.batch_grad(call, name))

    def _reduce(self, p, rule, call, name) -> None:
        """Reduced quantities of a parameter used once, via fast paths where the rule has them."""
        want = self.attrs.intersection(_REDUCED)
        l2 = rule.batch_l2(call, name) if "batch_l2" in want else None
        moments = want & {"sum_grad_squared", "variance"}
        sgs = rule.sum_grad_squared(call, name) if moments else None
        total = rule.grad_sum(call, name)  # also checked against p's whole gradient
        missing = {
            "batch_l2": "batch_l2" in want and l2 is None,
            "sum_grad_squared": bool(moments) and sgs is None,
            "grad_sum": "variance" in want and total is None,
        }
        if any(missing.values()):
            chunked = _reduce_in_chunks(rule, call, name, p.shape, missing)
            l2 = chunked.get("batch_l2", l2)
            sgs = chunked.get("sum_grad_squared", sgs)
            total = chunked.get("grad_sum", total)
        self._store(p, l2, sgs, total, call.batch_size)

    def on_parameter_grad(self, p, grad: torch.Tensor) -> None:
        """``p``'s whole gradient of this pass; checked against the per-sample gradients at the
        end of the pass (see :meth:`_check_totals`)."""
        self.param_grads[id(p)] = (p, grad)

    def _check_totals(self) -> None:
        """The per-sample gradients must sum to each parameter's gradient.

        Catches parameters also used outside the module that owns them (e.g. a tied output
        layer ``h @ embedding.weight.T``), whose per-sample gradients no hook can see. Exact
        where the sum is computed anyway (reduced quantities: every rule with a ``grad_sum``,
        chunked reductions, ``Variance``); a spot check of evenly spread entries for
        materialised per-sample gradients; conv weights reduced by ghost norms alone are not
        checked.
        """
        for key, (p, grad) in self.param_grads.items():
            if grad.is_sparse:
                continue
            if key in self.batch_grads:
                batch = self.batch_grads[key][1]
                batch, flat = batch.reshape(batch.shape[0], -1), grad.reshape(-1)
                spans = probe_spans(batch.shape[1])
                total = torch.cat([batch.narrow(1, a, w).sum(0) for a, w in spans])
                grad = torch.cat([flat.narrow(0, a, w) for a, w in spans])
            elif key in self.totals:
                total = self.totals[key]
            else:
                continue
            tol = 1e-4 * float(grad.abs().max()) + 1e-12
            if float((total - grad).abs().max()) > tol:
                raise UnsupportedModuleError(
                    f"curvopt: a parameter of shape {tuple(p.shape)} receives gradient from "
                    "outside the module that owns it (used functionally, e.g. a tied output "
                    "layer 'h @ embedding.weight.T'); per-sample quantities cannot see that "
                    "use. Use the parameter only through its module (e.g. an nn.Linear sharing "
                    "the weight)"
                )

    def _store(self, p, l2, sgs, total, n) -> None:
        if total is not None:
            self.totals[id(p)] = total
        if "batch_l2" in self.attrs:
            self.put(p, "batch_l2", l2)
        if "sum_grad_squared" in self.attrs:
            self.put(p, "sum_grad_squared", sgs)
        if "variance" in self.attrs:
            self.put(p, "variance", (sgs / n).sub_((total / n).pow_(2)))

    def put(self, p, attr: str, value: torch.Tensor) -> None:
        """Set ``p.<attr> = value`` when the pass has finished."""
        self.results[(id(p), attr)] = (p, value)

    def add_kron(self, p, attr: str, record, factors, out_index: int) -> None:
        """Kronecker factors of one module call: the output-side factor sums over column chunks
        and over losses; the input-side factors belong to the call. Two calls (a module used
        twice, or under two losses on different inputs) do not form one Kronecker product."""
        key = (id(p), attr)
        owner = self.kron_owner.get(key)
        if owner is None:
            self.kron_owner[key] = record
            self.put(p, attr, factors)
        elif owner is record:
            self.results[key][1][out_index].add_(factors[out_index])
        else:
            raise module_error(
                record.module,
                "Kronecker factors of a module used several times in one backward pass are not "
                "defined (the uses' input and output factors do not combine into one Kronecker "
                "product); use a diagonal quantity such as DiagGGNExact",
            )

    def add(self, p, attr: str, value) -> None:
        """Add ``value`` to the pending ``p.<attr>``."""
        old = self.results.get((id(p), attr))
        if old is None:
            self.put(p, attr, value)
        else:
            old[1].add_(value)

    # ---------------------------------------------------------------- end of pass
    def _finish(self) -> None:
        if self.failed:
            return
        try:
            self._check_totals()
        except BaseException:
            self._abort()
            raise
        for p, batch in self.batch_grads.values():
            if "grad_batch" in self.attrs:
                self.put(p, "grad_batch", batch)
            want = self.attrs.intersection(_REDUCED)
            if want:
                l2 = squared_norms(batch) if "batch_l2" in want else None
                sgs = sum_of_squares(batch) if want - {"batch_l2"} else None
                total = batch.sum(0) if "variance" in want else None
                self._store(p, l2, sgs, total, batch.shape[0])
        for (_, attr), (p, value) in self.results.items():
            setattr(p, attr, value)
        self.batch_grads.clear()
        self.results.clear()

    def _abort(self) -> None:
        """Forget everything written so far; the pass writes nothing."""
        self.failed = True
        self.batch_grads.clear()
        self.results.clear()
        self.param_grads.clear()


def _reduce_in_chunks(rule, call, name, shape, want):
    """The ``want``-ed of ``batch_l2`` (``[N]``), ``sum_grad_squared`` and ``grad_sum``
    (``p.shape``) from per-sample gradients, materialised chunk by chunk."""
    n = call.batch_size
    step = max(1, _CHUNK_ELEMENTS // max(1, torch.Size(shape).numel()))
    parts = {key: [] for key, wanted in want.items() if wanted}
    for start in range(0, n, step):
        chunk = rule.batch_grad(call.slice(start, min(n, start + step)), name)
        if "batch_l2" in parts:
            parts["batch_l2"].append(squared_norms(chunk))
        if "sum_grad_squared" in parts:
            parts["sum_grad_squared"].append(sum_of_squares(chunk))
        if "grad_sum" in parts:
            parts["grad_sum"].append(chunk.sum(0))
    return {
        key: torch.cat(values) if key == "batch_l2" else torch.stack(values).sum(0)
        for key, values in parts.items()
    }
