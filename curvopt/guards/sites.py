"""Raw parameters read where they meet the batch, instead of a re-run of their module.

The generic rule gets a module's per-sample gradients by re-running it sample by sample
(``layers.generic``); for a ViT whose class token and position embeddings are parameters of the
model itself, that re-runs the whole model. Such a parameter's only use is often an add or an
expand over the batch (``cls.expand(N, -1, -1)``, ``h + pos``), whose output gradient holds
sample ``n``'s gradient of it, reduced over the broadcast dims (``broadcast``; the same reading
as for a broadcast module call). A first-order pass hooks that op (``Walk.parameter_site``) and
hands what it reads to ``layers.parameter`` when the backward reaches it, before the
parameter's own gradient arrives, so the sum check sees it as any call's. The module's other
parameters, if any, still go through its rule.

That the broadcast dim is the batch is what the shapes suggest, not what they prove (inside
attention, a bias added over ``[L, N, E]`` with ``L == N``): the site must broadcast ``p``
along its leading dim alone, of the batch's size (``Walk.parameter_site``), and on the first
pass of each graph structure the rule still computes ``p``'s per-sample gradients, which the
site's reading must match (to the checks' tolerance) for the later passes of the structure to
use the site; the sum check cannot tell the two apart, both sum to ``p.grad``. A curvature
pass reads the same sites by its columns (``engine.parameter_sites``), verified by the row
probes instead; the verdict of whichever comes first is the structure's.
"""

from __future__ import annotations

from curvopt.core.calls import Call
from curvopt.core.plans import add_site
from curvopt.guards.observer import Ending, PassGuard
from curvopt.guards.pass_guards import autocast_off
from curvopt.core.records import token
from curvopt.engine.results import name_of
from curvopt.guards.tolerance import mismatch
from curvopt.errors import UnsupportedModuleError
from curvopt.layers.parameter import PARAMETER


class ParameterSites(PassGuard):
    """The parameters of one pass read at their sites: hooks registered into ``handles``
    (removed with the pass's), results into ``reducer``, sites found by the pass's ``walks``.
    The pass's ``active()`` (whether it still computes) and ``abort()`` (ends it on an error)
    live in the hooks only, which go with the pass's handles: nothing here refers back to the
    pass, so that it is freed when it ends, not by the garbage collector."""

    def __init__(self, reducer, checks, handles, walks):
        self.reducer, self.checks, self.handles, self.walks = reducer, checks, handles, walks
        self.pending: dict = {}  # id(p): p, hooked and not read yet

    def claim(self, rule, call, params, materialise: bool, active, abort) -> set:
        """The ids of the ``(name, p)`` in ``params`` read at a site (hooked now): the raw
        parameters of a module its rule would re-run (``rule.reruns_module``), batch first,
        whose site one of the pass's walks finds and whose structure's plan says that
        the site's reading matched the rule. On a structure's first pass the rule computes
        them as before and the site's reading is compared with it: its verdict goes into
        the plan (``core.plans.add_site``), which a data-indexed graph does not have."""
        if not rule.reruns_module or call.batch_dim != 0:
            return set()
        found = set()
        for name, p in params:
            walk, site = next(
                (
                    (w, s)
                    for w in self.walks
                    if w.plan is not None and (s := w.parameter_site(p, call.batch_size))
                ),
                (None, None),
            )
            if site is None:
                continue
            key = (token(call.module), name)
            matched = dict(walk.plan.sites).get(key)
            if matched is False:
                continue

            check = (walk, key, rule, call) if matched is None else None  # the first pass

            def read(grad_outputs, p=p, name=name, site=site, check=check):
                if not active() or grad_outputs[0] is None:
                    return
                try:
                    self._read(p, name, call.module, site, grad_outputs[0], materialise, check)
                except BaseException:
                    abort()
                    raise

            self.handles.append(site.edge.node.register_prehook(read))
            if matched:
                self.pending[id(p)] = p
                found.add(id(p))
        return found

    def _read(self, p, name, module, site, grad, materialise: bool, check) -> None:
        """``g_n = site.sample_grads(grad)`` as ``[N, *p.shape]``: into the reducer, or (a
        structure's first pass, ``check = (walk, key, rule, call)``) compared with the rule's."""
        with autocast_off():
            g = site.sample_grads(grad).reshape(site.samples, *p.shape).to(p.dtype)
            if check is not None:
                walk, key, rule, call = check
                add_site(walk, key, not mismatch(g, rule.batch_grad(call, name), 64))
                return
            del self.pending[id(p)]
            self.reducer.add(p, PARAMETER, Call(module, (), {}, g), name, materialise)

    def finish(self, ending: Ending) -> None:
        """Every hooked parameter that received a gradient (``checks``) was read."""
        for p in self.pending.values():
            if self.checks.has_grad(p):
                raise UnsupportedModuleError(
                    f"curvopt: parameter {name_of(p)!r} received a gradient, but the add or "
                    "expand where its per-sample gradients were to be read never ran in this "
                    "pass. Report the model as a curvopt bug."
                )
