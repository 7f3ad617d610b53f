"""Which parameters take part in one backward pass: those whose gradient it accumulates.

Only gradient that is accumulated into ``p.grad`` counts: a pass that does not accumulate into a
parameter (``torch.autograd.grad``, e.g. the input gradient of an adversarial attack, or
``backward(inputs=...)`` without it) writes nothing for it, and a parameter outside the pass's
``scope`` (an optimizer's own parameters) is left alone too; a parameter FSDP2 gathered for the
computation is in ``scope`` where its sharded parameter is (``sharded``).

A parameter the pass does not reach at all (an unused head, a skipped branch, an expert without
tokens) is a parameter of a model the pass went through (what ``extend`` was called on:
``params.model_parameters``) that the pass wrote nothing for. :meth:`Participation.left_out`
lists those, so that no value of an earlier pass stays on them (``accumulate.Accumulator.leave``).
A frozen parameter of such a model (``requires_grad=False``) gets nothing, and is listed too, so
that no value of a pass before it was frozen stays on it.
"""

from __future__ import annotations

from typing import Dict, Optional

from curvopt.graph.search import reaches
from curvopt.core.extended import module_entry
from curvopt.core.params import model_parameters, trainable
from curvopt.autograd.torch_internals import (
    current_autograd_node,
    grad_accumulator,
    will_engine_execute_node,
)


class Participation:
    """The parameters one pass accumulates into, looked up once each. ``scope``: ``id``s of
    the parameters the pass writes for (None: all); ``walks``: the pass's graph walks
    (``walk.Walk``, the list the pass appends to)."""

    def __init__(self, scope: Optional[set], walks: list):
        self.scope = scope
        self.walks = walks
        self.untouched: Dict[int, bool] = {}  # id(p): the pass does not accumulate into p.grad
        self.parameters: Dict[int, tuple] = {}  # id(module): ``of``'s answer
        #: autograd nodes outside the walks whose upstream ``_reaches`` has walked
        self.reached: dict = {}
        #: id(model) -> model: the models of the modules whose parameters the pass takes
        self.models: Dict[int, object] = {}
        #: id(gathered) -> sharded parameter (FSDP2, ``core.sharded``): in ``scope`` as it is
        self.sharded: Dict[int, object] = {}

    def skips(self, p) -> bool:
        """Whether this pass leaves ``p.grad`` alone (``torch.autograd.grad``, ``backward(inputs=
        ...)`` without ``p``): ``p``'s gradient accumulator is in the graph, but the engine will
        not run it. (A parameter outside the graph, unused in this pass, is not skipped: it gets
        zeros, as its module's output gradient says.) A parameter outside the pass's ``scope``
        is skipped too: the pass computes and writes nothing for it."""
        key = id(p)
        skip = self.untouched.get(key)
        if skip is not None:  # (looked up once a pass)
            return skip
        if self.scope is not None and id(self.sharded.get(key, p)) not in self.scope:
            skip = True
        else:
            accumulator = self._accumulator(p, key)
            try:
                skip = not will_engine_execute_node(accumulator) and self._reaches(accumulator)
            except RuntimeError:  # p is an input of torch.autograd.grad
                skip = True
        self.untouched[key] = skip
        return skip

    def _accumulator(self, p, key: int):
        """``p``'s ``AccumulateGrad`` node (``key``: ``id(p)``): as a walk of this pass met it,
        else made from ``p`` (``grad_accumulator``, a view of ``p``: the same node)."""
        for walk in self.walks:
            node = walk.accumulators.get(key)
            if node is not None:
                return node
        return grad_accumulator(p)

    def _reaches(self, node) -> bool:
        """Whether ``node`` lies upstream of the autograd node running now: in the walk of an
        extended loss's graph, or else upstream of the node running now, walked incrementally
        (a node seen before had its whole upstream walked). That second walk runs only for a
        parameter whose accumulator the engine will not run (``torch.autograd.grad``) and that
        no loss's walk reached (no extended loss: Hugging Face's ``labels=``), a graph part the
        walks have not read, or where a walk went through a re-run reentrant checkpoint (the
        engine's graph does not: the parameters inside reach it only in torch's re-run)."""
        if any(node in walk.edges for walk in self.walks if not walk.checkpoints):
            return True
        return reaches(current_autograd_node(), node, self.reached)

    def of(self, module) -> tuple:
        """``(trainable, taking part)``: ``module``'s trainable ``(name, p)`` and those of them
        whose gradient this pass accumulates."""
        key = id(module)
        found = self.parameters.get(key)
        if found is None:
            entry = module_entry(module)  # (read once: its parameters and its models)
            params = trainable(module, entry)
            found = self.parameters[key] = params, [(n, p) for n, p in params if not self.skips(p)]
            if found[1] and entry is not None:  # the models of ``models_of``
                models = self.models
                for ref in entry.models:
                    model = ref()
                    if model is not None:
                        models.setdefault(id(model), model)
        return found

    def left_out(self, written) -> list:
        """``(p, excluded)`` for each parameter of the models this pass went through (in its
        ``scope``) that it did not write for (``written``: their ``id``s): ``excluded`` where
        the pass leaves ``p.grad`` alone on purpose (``backward(inputs=...)`` without it, or
        ``p`` frozen: it gets nothing), else it did not reach ``p`` (its per-sample gradients
        are zero)."""
        found: Dict[int, tuple] = {}
        scope = self.scope
        for model in self.models.values():
            for p in model_parameters(model):
                key = id(p)
                if key in written or key in found or (scope is not None and key not in scope):
                    continue
                found[key] = (p, not p.requires_grad or bool(self.untouched.get(key)))
        return list(found.values())

    def among(self, calls) -> list:
        """The ``(name, p)`` of the module calls ``calls`` whose gradient this pass accumulates."""
        return [found for record in calls for found in self.of(record.module)[1]]

    def skips_all(self, modules) -> bool:
        """The pass accumulates into none of the trainable parameters of ``modules`` (and there
        is one)."""
        any_params = any_taking = False
        for module in modules:  # every module looked up (``of`` is remembered), as it runs now
            params, taking = self.of(module)
            any_params = any_params or bool(params)
            any_taking = any_taking or bool(taking)
        return any_params and not any_taking
