"""One backward pass inside ``collect``, as a small event loop: results written when it ends.

Results are buffered and written as attributes by a callback the autograd engine runs at the
end of the pass, so an exception in the middle leaves no half-written attribute (a value
being replaced is taken off its parameter first: ``buffers``, ``Accumulator.release``).

``BackwardPass`` handles four events, each a hook of the autograd engine: an extended loss's
gradient (``on_loss``), a module call's output gradient (``on_module``), a parameter's whole
gradient (``on_parameter_grad``) and the end of the pass (``_finish``). It hands the work to the
engine: the first-order reducer (``engine.reducer``), the raw parameters read at their sites
(``engine.parameter_sites.SiteReadings``, whose readers it hooks), the curvature
(``engine.curvature``) and the result buffer all of them contribute to (``engine.results``).
The guards observe the events and the values the engine hands them (``guards.observer``; each
call's ``sum_n g_n``: the reducer's ``total`` event) and raise; they write no result: the flow
check (``guards.flow``: on every pass, a term whose weight is zero on one pass may not be on
the next), every site claimed read (``guards.sites``) and the sum checks (``guards.checks``), in
that order; the preconditions of an event (``guards.pass_guards``) are checked where it
starts. Which parameters take part is
``guards.participation``'s: a pass that accumulates into none of the parameters it reaches is
ignored altogether (its module inputs stay, so a retained graph can still be backpropagated).
When a pass ends, the parameters of its models that it did not write for hold no earlier value
(``Participation.left_out``, ``Accumulator.leave``).

Where a pass stands is one ``Phase``: waiting for its first hook, first order without an
extended loss, collecting after a loss's hook, ignored, failed, or done (the engine's callback
ran).
"""

from __future__ import annotations

import enum
from typing import Callable, Dict, Optional

import torch

from curvopt.guards.checks import Checks
from curvopt.guards.observer import Ending, LossEvent, ModuleEvent, Observers
from curvopt.engine.curvature import CurvaturePass
from curvopt.guards.flow import FlowCheck
from curvopt.core.extended import live_calls, models_of
from curvopt.core.params import tied
from curvopt.core.passgrad import held
from curvopt.core.sharded import Gathered, any_fully_sharded, sharded_index, tied_gathered
from curvopt.guards.participation import Participation
from curvopt.guards.pass_guards import check_reduction, missing_loss, without_autocast
from curvopt.guards.pass_guards import one_batch_size
from curvopt.engine.probes import Probes
from curvopt.engine.reducer import FirstOrderReducer
from curvopt.engine.results import ResultBuffer
from curvopt.engine.parameter_sites import SiteReadings
from curvopt.guards.sites import SitesRead, site_agrees
from curvopt.engine.rows import establish
from curvopt.autograd.torch_internals import current_autograd_node, current_graph_task_id
from curvopt.autograd.torch_internals import queue_callback
from curvopt.graph.walk import Walk
from curvopt.errors import UnsupportedLossError, UnsupportedModuleError, module_error
from curvopt.layers import rule_for
from curvopt.losses import loss_rule_for


class Phase(enum.Enum):
    """Where one backward pass stands."""

    WAITING = "no extended loss or module hook has run yet"
    WITHOUT_LOSS = "first order: module hooks run, no extended loss's has"
    COLLECTING = "an extended loss's hook ran: its curvature is computed"
    IGNORED = "it accumulates into none of the parameters it reaches: nothing is done"
    FAILED = "an exception was raised: nothing will be written"
    DONE = "the engine's callback at the end of the pass ran"


class BackwardPass:
    """One pass's event loop: ``on_loss`` (the extended loss's hook), ``on_module`` (every
    extended module's), ``on_parameter_grad`` (every parameter's), ``_finish`` (the end); the
    guards observe each (``guards``, in order)."""

    def __init__(
        self,
        extensions,
        task: int,
        accumulator,
        skipped=None,
        diagonal=False,
        scope=None,
        terms: Optional[Callable[[BaseException], BaseException]] = None,
    ):
        self.task = task
        #: the errors of the pass in the terms of whom asked (``collect.terms``): an error
        #: raised from a hook, rephrased (or the same one)
        self.terms = terms
        #: ``collect(skip_unsupported=...)``: where to report the parameters left out (the
        #: result buffer does), and whether they get the diagonal of the curvature instead
        self.results = ResultBuffer(skipped)
        self.skip_diagonal = diagonal
        self.extensions = extensions
        self.accumulator = accumulator
        self.second_order_exts = [ext for ext in extensions if ext.order == 2]
        self.phase = Phase.WAITING
        self.batch_size: Optional[int] = None
        self.reused: Dict[int, bool] = {}
        self.checks = Checks()
        self.reducer = FirstOrderReducer(extensions, self.results, Probes(task))
        self.first = self.reducer.first  # first-order implementation -> the attributes it writes
        self.handles: list = []  # hooks on autograd nodes, removed when the pass ends
        self.upstream: list = []  # module calls upstream of the extended losses
        self.walks: list = []  # the graph walks of this pass (``walk.Walk``)
        self.taking = Participation(scope, self.walks)  # the parameters it accumulates into
        self.sites = SiteReadings(self.reducer, self.walks, site_agrees)
        read = SitesRead(self.sites, self.checks)
        self.guards = Observers((FlowCheck(task), read, self.checks))  # in this order
        self.reducer.observers = self.guards.total  # each call's sum_n g_n, to the sum checks
        # what the losses' walks found: a reentrant checkpoint re-run (``checkpointing``),
        # curvature through a module mixing samples (``curvature``)
        self.checkpointed = False
        self.coupled = False
        self.gathered = Gathered()  # FSDP2's modules, gathered from the loss on
        self.tied_gathered: set = set()  # FSDP2's gathered parameters of several modules
        queue_callback(self._finish)

    @property
    def running(self) -> bool:
        """Until the engine's callback at the end of the pass."""
        return self.phase is not Phase.DONE

    # ---------------------------------------------------------------- hooks
    def on_loss(self, record, grad) -> bool:
        """The gradient reached an extended loss: check it, then compute all curvature. False
        where the pass is ignored (the loss's record stays for another pass)."""
        if self.phase in (Phase.FAILED, Phase.IGNORED):
            return self.phase is Phase.FAILED
        segments: list = []
        try:
            return without_autocast(self._on_loss, record, grad, segments)
        except BaseException as error:
            self._abort()
            self._raise_in_terms(error)
            raise
        finally:
            for segment in segments:  # the re-run checkpoints (``checkpointing``)
                segment.release()

    def _on_loss(self, record, grad, segments) -> bool:
        check_reduction(record.module)
        if not (self.second_order_exts or self.first):
            return True
        upstream = Walk(record.output, segments if self.second_order_exts else None)
        self.walks.append(upstream)
        if not upstream.calls and upstream.foreign:
            raise UnsupportedModuleError(
                f"curvopt: the input of the extended loss {type(record.module).__name__} "
                f"depends on parameters (one of shape {tuple(upstream.foreign[0].shape)}) "
                "of modules that were not extended. Extend the model too: "
                "model = curvopt.extend(model); see docs/support.md#modules-that-are-not-extended."
            )
        if any_fully_sharded():  # (else no module is: ``core.sharded``)
            self._gather(upstream.calls)
        if self.taking.skips_all(r.module for r in upstream.calls):
            self.phase = Phase.IGNORED
            return False
        self.phase = Phase.COLLECTING
        if not self.second_order_exts:
            self._check_layout(record, upstream)
            return True
        self.accumulator.release(self.taking.among(upstream.calls), self.second_order_exts)
        cpass = CurvaturePass(
            self.results, self.second_order_exts, record, grad, self.skip_diagonal
        )
        cpass.check(upstream, per_sample=self.reducer.per_sample)
        if cpass.coupled:  # EKFAC's S from the columns (``reducer``)
            self.reducer.couple()
        self.coupled = self.coupled or cpass.coupled  # BatchNorm's hook: checked there
        self.watch_broadcasts(upstream.calls)
        cpass.run(upstream)
        if cpass.coupled:
            self.reducer.correct_columns(cpass.eigen_columns())
        self.batch_size = self.batch_size or cpass.layout.samples
        event = LossEvent(upstream, current_autograd_node(), self._active, self._abort)
        for observe in self.guards.loss:
            observe(event)
        self.checkpointed = self.checkpointed or bool(segments)
        return True

    def _gather(self, calls) -> None:
        """FSDP2: the pass computes with the gathered parameters of the models of ``calls``."""
        models = {id(m): m for r in calls for m in models_of(r.module)}.values()
        self.gathered.hold(models)
        sharded = sharded_index(models)
        self.taking.sharded.update(sharded)
        self.results.sharded.update(sharded)
        self.tied_gathered |= tied_gathered(models)

    def _active(self) -> bool:
        return self.phase not in (Phase.FAILED, Phase.IGNORED)

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
        probe = upstream.key is not None or upstream.indexes_inside
        if upstream.calls and probe and not upstream.reentrant:
            output = record.output
            establish(
                output,
                output.shape,
                upstream.calls,
                upstream.batchable,
                upstream,
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
                    broadcast.grad = broadcast.sample_grads(grad_outputs[0])

                self.handles.append(broadcast.edge.node.register_prehook(keep))

    def _watch_upstream(self, record) -> None:
        """First order without an extended loss (Hugging Face's ``labels=`` loss): at the first
        module hook, find the broadcast calls upstream of the node now running (the one that
        produced ``record``'s output), whose per-sample gradients still exist downstream."""
        self.phase = Phase.WITHOUT_LOSS
        node = current_autograd_node()
        if node is None:
            return
        walk = Walk(node)
        self.walks.append(walk)
        calls = walk.calls
        if record in calls:
            record.broadcast = None  # its gradient has arrived already, summed or not
        self.watch_broadcasts([r for r in calls if r is not record])

    def on_module(self, record, grads) -> bool:
        """One module call's output gradient. False where the pass leaves the call alone (it
        accumulates into none of its parameters): its record stays for another pass."""
        if self.phase is Phase.FAILED:
            return True
        if self.phase is Phase.IGNORED:
            return False
        owned, params = self.taking.of(record.module)  # (``skips_all`` of the one module)
        if owned and not params:
            return False
        try:
            without_autocast(self._on_module, record, grads, params)
        except BaseException as error:
            self._abort()
            self._raise_in_terms(error)
            raise
        return True

    def _on_module(self, record, grads, params) -> None:
        """``params``: the ``(name, p)`` of the call's module this pass accumulates into."""
        module = record.module
        if self.phase is Phase.WAITING and self.first:
            self._watch_upstream(record)
        if record.broadcast is not None:
            grads = (record.broadcast.grad,)  # per sample, read downstream of the broadcast
        if record.transposed:  # (else ``batch_first`` is the identity)
            grads = tuple(record.batch_first(g) for g in grads)
        if len(grads) > 1 and grads[0] is None:  # the batch size is read from the first output
            zeros = torch.zeros(record.out_shapes[0], dtype=record.dtype, device=record.device)
            grads = (zeros, *grads[1:])
        if self.second_order_exts:
            if self.phase is not Phase.COLLECTING:
                raise missing_loss(self.second_order_exts)
        elif not self.first:
            return
        # (inside a checkpoint, torch's nested backward: the flow hooks check its node)
        nested = self.checkpointed and current_graph_task_id() != self.task
        event = ModuleEvent(record, grads, params, bool(self.second_order_exts) and not nested)
        for observe in self.guards.module:
            observe(event)
        rule = rule_for(module)
        reason = None if self.coupled and not self.first else rule.check(module)
        if reason is not None:
            raise module_error(module, reason)
        grad_out = grads[0] if len(grads) == 1 else grads
        if not self.first:
            if self.checks.sums:  # (those read at their sites: verified by the probes)
                call = record.call(grad_out)
                for name, p in params:
                    if name not in (record.sites or ()):
                        self.reducer.add_total(p, rule, call, name)
            return
        call = record.call(grad_out)
        self.batch_size = one_batch_size(call, self.batch_size)
        materialise = self.reducer.keeps_per_sample or self._reused(module, params)
        at_sites, readers = self.sites.claim(rule, call, params, materialise)
        for node, reader in readers:
            self.handles.append(node.register_prehook(self._site_hook(reader)))
        # (the sums of a pass whose per-sample gradients feed only EKFAC's ``S``, a curvature
        # quantity, are checked as a curvature-only pass's: on a structure's first pass)
        sums = self.reducer.per_sample or self.checks.sums
        for name, p in params:
            if id(p) not in at_sites:
                self.reducer.add(p, rule, call, name, materialise, sums)

    def _site_hook(self, reader):
        """The hook reading a raw parameter's site (``SiteReadings.claim``) while the pass
        computes, with autocast off; an error ends the pass."""
        active, abort = self._active, self._abort

        def hook(grad_outputs):
            if not active() or grad_outputs[0] is None:
                return
            try:
                without_autocast(reader, grad_outputs[0])
            except BaseException:
                abort()
                raise

        return hook

    def _reused(self, module, params) -> bool:
        """Whether ``module`` is called several times in this pass or shares a parameter with
        another module (decided at its first call, while its later calls still await their
        gradients; FSDP2's gathered parameters: ``core.sharded.tied_gathered``): its
        per-sample gradients are summed before they are reduced."""
        key = id(module)
        reused = self.reused.get(key)
        if reused is None:
            reused = live_calls(module) > 1
            for _, p in params:  # (a loop: a generator costs a call per step)
                if reused:
                    break
                reused = tied(p) or id(p) in self.tied_gathered
            self.reused[key] = reused
        return reused

    def on_parameter_grad(self, p, grad: torch.Tensor) -> None:
        """``p``'s whole gradient of this pass. Its hook normally runs after those of all the
        module calls using ``p`` (a module whose outputs depend on each other is the
        exception), so the sum of per-sample gradients is checked at whichever comes last."""
        if not self._active() or not (self.first or self.second_order_exts):
            return
        if self.taking.skips(p):
            return
        try:
            kept = held(p, grad)  # (what the pass keeps of it: autograd may still take it over)
            self.reducer.parameter_grad(p, kept)
            # (the sum check computes: projected sums, matmuls)
            without_autocast(self._observe_parameter, p, grad, kept)
        except BaseException as error:
            self._abort()
            self._raise_in_terms(error)
            raise

    def _observe_parameter(self, p, grad, kept) -> None:
        for observe in self.guards.parameter:
            observe(p, grad, kept)

    # ---------------------------------------------------------------- end of pass
    def _finish(self) -> None:
        failed = self.phase is Phase.FAILED
        self.phase = Phase.DONE
        without_autocast(self._finish_pass, failed)

    def _finish_pass(self, failed: bool) -> None:
        self.gathered.release()
        for handle in self.handles:
            handle.remove()
        self.walks.clear()
        if failed:
            return
        ending = Ending(
            self.results, {e.attr for e in self.second_order_exts}, self.reducer.batch_grads
        )
        try:
            for observe in self.guards.finish:
                observe(ending)
        except BaseException:
            self._abort()
            raise
        self.reducer.finish()
        n = self.batch_size or 0
        sharded = self.results.sharded
        if any_fully_sharded():
            sharded.update(sharded_index(self.taking.models.values()))
        written = self.results.write(self.accumulator, n, self.taking.untouched)
        written |= {key for key, target in sharded.items() if id(target) in written}
        self.accumulator.leave(self.taking.left_out(written), self.extensions, n)
        self.reducer.clear()
        for release in self.guards.release:
            release()

    def _raise_in_terms(self, error: BaseException) -> None:
        """Raise ``error`` rephrased in the terms of whom asked for this pass (``terms``), with
        its traceback and cause; return where it needs no rephrasing."""
        rephrased = error if self.terms is None else self.terms(error)
        if rephrased is not error:
            raise rephrased.with_traceback(error.__traceback__) from error.__cause__

    def _abort(self) -> None:
        """Forget everything written so far; the pass writes nothing. The calls whose hooks will
        not run now drop their inputs (an exception's traceback may keep the graph alive)."""
        if self.phase is not Phase.DONE:  # (an error of the end's checks: the pass is over)
            self.phase = Phase.FAILED
        self.gathered.release()
        for record in self.upstream:
            record.release()
        for handle in self.handles:
            handle.remove()
        self.walks.clear()
        self.reducer.clear()
        self.results.clear()
        for release in self.guards.release:
            release()
