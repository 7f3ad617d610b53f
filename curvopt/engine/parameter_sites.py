"""Raw parameters read at their sites: calls of their own, not a re-run of their module.

A module whose rule re-runs it sample by sample (``layers.generic``) may own raw parameters
that meet the batch through one add or expand (a ViT's class token, position embeddings and
register tokens; ``layers.parameter``). A curvature pass binds each such parameter as a call of
its own, :class:`SiteCall`, whose output is the site (``Walk.parameter_site``: the op's output,
read by sample as a broadcast call's, ``graph.broadcast``): the columns reach it in the same
``propagate.to_calls`` as every call's, and ``layers.parameter.ParameterRule`` turns them into
diagonals or factors; the module's rule computes its other parameters (``Record.computed``), and
the module is not re-run for these.

That the site's leading dim is the batch is what the shapes suggest, not what they prove (a
parameter expanded along a dim of the batch's size and summed over it). On a structure's first
pass, the probes of ``rows`` on each sample's rows must reach the site on that sample alone
(``rows.reaches_own_samples``): then the site's ``u_n`` reaches sample ``n``'s loss alone and
``reduce(J_uᵀ v)_n = J_nᵀ v_n``. The verdict is kept in the structure's plan
(``core.plans.add_site``, shared with the first-order reading, :class:`SiteReadings`); a
parameter whose site fails is computed by its module's rule, as before.

A first-order pass reads the same sites by the gradient arriving there (:class:`SiteReadings`):
the op's output gradient holds sample ``n``'s gradient of the parameter, reduced over the
broadcast dims, read when the backward reaches the op, before the parameter's own gradient
arrives, and handed to ``layers.parameter`` as a call of its own, so the sum check sees it as
any call's. On a structure's first pass the module's rule still computes the parameter's
per-sample gradients, which the site's reading must match (the checks' tolerance, given by the
pass) for the later passes of the structure to use the site: the sum check cannot tell the two
apart, both sum to ``p.grad``. The verdict of whichever pass comes first, this or the
curvature's probes, is the structure's.
"""

from __future__ import annotations

from curvopt.core.calls import Call
from curvopt.core.params import trainable
from curvopt.core.plans import add_site
from curvopt.core.records import Record, token
from curvopt.core.state import STATE
from curvopt.engine.rows import reaches_own_samples
from curvopt.layers import rule_for
from curvopt.layers.parameter import PARAMETER, RawParameter


class SiteCall:
    """The raw parameter ``name`` of the call ``owner`` (a ``records.Record``) read at ``site``
    (a ``broadcast.Broadcast``): a call of the pass with the record's interface, its module a
    ``RawParameter`` holding that parameter alone."""

    transposed = False
    positionwise = False
    batch_dim = 0
    sites = None

    def __init__(self, owner, name: str, p, site):
        self.module = RawParameter(owner.module, name, p)
        self.owner = owner
        self.broadcast = site
        self.args, self.kwargs = (), {}
        self.out_shapes = (p.shape,)
        #: the columns held at the site per column: ``[N, *p.shape]``
        self.out_numel = (site.samples * p.numel(),)
        self.dtype, self.device, self.seq = owner.dtype, owner.device, owner.seq

    @property
    def batch_size(self) -> int:
        return self.broadcast.samples

    def at_parameter_precision(self, value):
        return self.owner.at_parameter_precision(value)

    def call(self, grad_out=None) -> Call:
        return Call(self.module, (), {}, grad_out, quiet=STATE.suspend)

    #: the call given the columns at the site, as a record's (``Record.column_call``: through
    #: :meth:`call` and :meth:`at_parameter_precision`)
    column_call = Record.column_call

    def computed(self) -> list:
        """``[(name, p)]``: the one parameter this call computes."""
        return trainable(self.module)


def with_sites(calls, walk, source, batched: bool, layout) -> dict:
    """``calls`` (``{record: [(output index, edge)]}`` of ``walk``, the walk of ``source``),
    with the :class:`SiteCall` of every raw parameter read at its site, verified on the
    structure's first pass by the probes on ``layout``'s rows (module doc); the owners'
    ``Record.sites`` bound. For a walk that met a broadcasting op (``Walk.broadcasting``): a
    site is one; the plain path does not come here."""
    if walk.plan is None:
        return calls
    found = dict(calls)
    for record in calls:
        if not _reruns(record):
            continue
        for name, p in trainable(record.module):
            site = walk.parameter_site(p, layout.samples)
            if site is None:
                continue
            key = (token(record.module), name)
            verdict = walk.plan.site(key)
            if verdict is False:
                continue
            bound = (record.sites or {}).get(name)
            if bound is None or bound.broadcast.edge != site.edge:
                bound = SiteCall(record, name, p, site)
            edges = {bound: [(0, site.edge)]}
            if verdict is None:
                verdict = reaches_own_samples(source, source.shape, edges, batched, walk, layout)
                add_site(walk, key, verdict)
                if not verdict:
                    continue
            record.sites = {**(record.sites or {}), name: bound}
            found.update(edges)
    return found


def _reruns(record) -> bool:
    """Whether ``record``'s rule would re-run its module for its raw parameters, batch first."""
    return (
        rule_for(record.module).reruns_module
        and record.batch_dim == 0
        and record.broadcast is None
        and not record.transposed
    )


class SiteReadings:
    """The raw parameters of one first-order pass read at their sites (module doc): each read
    goes into ``reducer``; the sites are found by the pass's ``walks``; ``agrees(reading,
    rule's)`` is the tolerance of a structure's first comparison. The pass registers the
    readers :meth:`claim` returns as hooks (its own: whether it still computes, its abort on an
    error); nothing here refers back to the pass. ``pending``: ``id(p) -> p``, claimed and not
    read yet (a guard checks at the end that each one with a gradient was read)."""

    def __init__(self, reducer, walks, agrees):
        self.reducer, self.walks, self.agrees = reducer, walks, agrees
        self.pending: dict = {}

    def claim(self, rule, call, params, materialise: bool):
        """``(ids, readers)``: the ids of the ``(name, p)`` in ``params`` read at a site, and
        ``(node, read)`` for each site to read, ``read(grad)`` with the gradient arriving at
        ``node``. Claimed: the raw parameters of a module its rule would re-run
        (``rule.reruns_module``), batch first, whose site one of the pass's walks finds and
        whose structure's plan says that the site's reading matched the rule. On a structure's
        first pass the rule computes them as before and the site's reading is compared with
        it: its verdict goes into the plan (``core.plans.add_site``), which a data-indexed
        graph does not have."""
        if not rule.reruns_module or call.batch_dim != 0:
            return set(), []
        found, readers = set(), []
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
            matched = walk.plan.site(key)
            if matched is False:
                continue
            check = (walk, key, rule, call) if matched is None else None  # the first pass

            def read(grad, p=p, name=name, site=site, check=check):
                self._read(p, name, call.module, site, grad, materialise, check)

            readers.append((site.edge.node, read))
            if matched:
                self.pending[id(p)] = p
                found.add(id(p))
        return found, readers

    def _read(self, p, name, module, site, grad, materialise: bool, check) -> None:
        """``g_n = site.sample_grads(grad)`` as ``[N, *p.shape]``: into the reducer, or (a
        structure's first pass, ``check = (walk, key, rule, call)``) compared with the rule's."""
        g = site.sample_grads(grad).reshape(site.samples, *p.shape).to(p.dtype)
        if check is not None:
            walk, key, rule, call = check
            add_site(walk, key, self.agrees(g, rule.batch_grad(call, name)))
            return
        del self.pending[id(p)]
        self.reducer.add(p, PARAMETER, Call(module, (), {}, g), name, materialise)
