"""The flow check of a curvature pass: the gradient flowing into the graph upstream of the
extended losses enters through them alone (nothing from other terms of the objective).

It costs no propagated column. The graph upstream of each extended loss is known (the pass's
``walk.Walk``); at every node of it that lies downstream of what curvopt reads (a module call's
output, an extended parameter), the gradient the autograd engine hands the node must be the
sum of what the node's consumers inside that graph sent it. A node with one such consumer
receives the very tensor it sent unless something else adds to it (an identity test, no
arithmetic); anything else is compared by value (``tolerance.mismatch``), so that a term whose
weight is 0 on this pass passes and the same term with weight 0.3 on the next raises. It runs
on every pass, from hooks on the nodes, each acting only in its pass's autograd task.

A node that passes gradient on gets one hook, run after it: it checks what the node received
(the gradients the engine handed it, ``grad_outputs``, the ones it computed with) and records
what it sent. A node that passes none on (a parameter's ``AccumulateGrad``) has nothing to
record: it gets its check alone, run before it (``p.grad`` is not touched where the check
fails). So does a custom ``autograd.Function``'s node (a reentrant checkpoint's): its backward
is Python, which may run a nested backward pass, and the check comes before that.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Dict, Tuple

from curvopt.graph.search import search
from curvopt.core.plans import add_region
from curvopt.engine.results import name_of
from curvopt.core.reductions import dense_gradient
from curvopt.guards.tolerance import mismatch
from curvopt.autograd.torch_internals import (
    ACCUMULATE_GRAD,
    PYTHON_FUNCTION_NODE,
    current_autograd_node,
)
from curvopt.autograd.torch_internals import current_graph_task_id
from curvopt.errors import UnsupportedModuleError, module_error
from curvopt.guards.observer import LossEvent, ModuleEvent, PassGuard

#: the fix of every gradient that does not come from the extended losses alone
_OUTSIDE = (
    "Backpropagate only sums of extended losses inside collect; see "
    "docs/support.md#gradient-from-other-terms."
)


class FlowCheck(PassGuard):
    """The flow check of one pass (autograd task ``task``): hooks on each extended loss's graph
    at its ``loss`` event, the unreached calls at each ``module`` event."""

    def __init__(self, task: int):
        self.task = task
        self.reached: set = set()  # module calls upstream of the extended losses
        self.watched: set = set()  # autograd nodes whose incoming gradient is checked
        self.checked_after: set = set()  # those of them checked by their hook run after them
        self.senders: dict = {}  # autograd node whose outgoing gradient is recorded -> its edges
        self.sent: Dict[Tuple[object, int], list] = defaultdict(list)  # (node, nr): gradients
        self.modules: dict = {}  # autograd node -> the module whose call's output it produced
        self.active: Callable[[], bool] = lambda: False  # the pass's, from its first loss
        self.abort: Callable[[], None] = lambda: None

    def watch(self, walk, loss_node, active: Callable[[], bool], abort: Callable[[], None]):
        """Hooks on the graph upstream of one extended loss (``walk``: of its input;
        ``loss_node``: its output's node), registered after the curvature's own backward ran
        through the graph; they act while ``active()`` (in this pass's autograd task, until
        :meth:`release`) and call ``abort()`` before raising. A node that passes gradient on
        gets one hook after it (its check too, module docstring), any other checked node one
        before it; the hooks are the same for every node and find the node they run for as
        the engine's current node: no closure and no handle per node (their garbage would be
        collected on every pass); after the pass they stay on the graph, inert, until it is
        freed."""
        self.active, self.abort = active, abort
        check, send = self._region(walk, loss_node)
        on_sent, on_arrival = self._on_sent, self._on_arrival
        senders = self.senders
        for node in send:
            nexts = walk.next_of(node)
            if nexts:  # (nothing to record for a node that passes no gradient on)
                senders[node] = nexts
                node.register_hook(on_sent)
        for node in check:
            if node in senders and not isinstance(node, PYTHON_FUNCTION_NODE):
                self.checked_after.add(node)
            else:
                node.register_prehook(on_arrival)

    def _on_sent(self, grad_inputs, grad_outputs) -> None:
        if current_graph_task_id() == self.task and self.active():
            node = current_autograd_node()
            if node in self.checked_after:
                try:
                    self.check_flow(node, grad_outputs)
                except BaseException:
                    self.abort()
                    raise
            self.record_sent(self.senders[node], grad_inputs)

    def _on_arrival(self, grad_outputs) -> None:
        if current_graph_task_id() != self.task or not self.active():
            return
        try:
            self.check_flow(current_autograd_node(), grad_outputs)
        except BaseException:
            self.abort()
            raise

    def _region(self, walk, loss_node):
        """The nodes newly to check (``check_flow``, :meth:`watch` says where) and newly to record
        (``record_sent`` after they ran): those of the graph that lie downstream of a module
        call's output or an extended parameter, and the loss's own nodes between its output
        and its input."""
        self.reached.update(walk.calls)
        # a re-run reentrant checkpoint takes its re-run outputs (no input index): its node is
        # checked like a call's output, named by its segment (``checkpointing``)
        modules = self.modules
        for node in walk.checkpoints:
            modules[node] = walk.segment_of(node)
        read = [*walk.checkpoints]  # this walk's nodes whose output is read
        for record, edges in walk.calls.items():  # (loops: a generator costs a call per step)
            for _, edge in edges:
                modules[edge.node] = record.module
                read.append(edge.node)
        numbers = walk.numbers
        leaves = tuple([numbers[n] for n in walk.extended_leaves])
        known = None if walk.plan is None else walk.plan.region(leaves)
        if known is None:  # downstream of what is read
            users = walk.users
            starts = [*read, *[n for n in walk.extended_leaves if n in users]]
            region = list(search(starts, lambda node: users.get(node, ())))
            add_region(walk, leaves, tuple([numbers[n] for n in region]))
        else:  # the structure's, for these extended leaves: bound to this pass's nodes
            nodes = list(numbers)
            region = [nodes[i] for i in known]
        check = [n for n in region if n not in self.watched]
        self.watched.update(check)
        inside = walk.between(loss_node)
        send = [n for n in (*region, *inside) if n not in self.senders]
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
            grad = dense_gradient(grad)
            if not sent:
                bad = bool(grad.any())
            else:
                total = dense_gradient(sent[0]).to(grad.dtype)
                for other in sent[1:]:
                    total = total + dense_gradient(other).to(grad.dtype)
                bad = total.shape != grad.shape or mismatch(total, grad, 256)
            if bad:
                raise _flow_error(node, self.modules.get(node))

    def loss(self, event: LossEvent) -> None:
        self.watch(event.walk, event.node, event.active, event.abort)

    def module(self, event: ModuleEvent) -> None:
        if event.curvature:
            self.check_unreached(event.record, event.grads)

    def check_unreached(self, record, grads) -> None:
        """A module call that no extended loss reaches gets no gradient."""
        if record not in self.reached and any(g is not None and bool(g.any()) for g in grads):
            raise module_error(
                record.module,
                "its output gradient does not come from the extended loss(es) alone (none of "
                f"them depends on it). {_OUTSIDE}",
            )

    def release(self) -> None:
        """The pass is over: the hooks left on the graph do nothing from now on; drop the
        references to the graph's nodes and gradients."""
        self.task = None
        self.active, self.abort = lambda: False, lambda: None
        self.reached.clear()
        self.sent.clear()
        self.watched.clear()
        self.checked_after.clear()
        self.senders.clear()
        self.modules.clear()


def _flow_error(node, module) -> Exception:
    """The error for gradient from outside the extended losses arriving at ``node`` (the
    output of a call of ``module``, if not None)."""
    if type(node).__name__ == ACCUMULATE_GRAD:
        return UnsupportedModuleError(
            f"curvopt: parameter {name_of(node.variable)!r} receives gradient from outside the "
            "module that owns it and the extended loss(es) (a penalty, or a use elsewhere). "
            "Backpropagate only sums of extended losses, and pass an L2 penalty as the "
            "optimizer's weight_decay=; see docs/support.md#gradient-from-other-terms."
        )
    if module is not None:
        return module_error(
            module,
            f"its output gradient does not come from the extended loss(es) alone. {_OUTSIDE}",
        )
    return UnsupportedModuleError(
        f"curvopt: the gradient of an intermediate result (autograd node {type(node).__name__}) "
        f"does not come from the extended loss(es) alone. {_OUTSIDE}"
    )
