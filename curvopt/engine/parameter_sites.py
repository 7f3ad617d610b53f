"""Raw parameters read at their sites in a curvature pass: calls of their own, not a re-run.

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
(``core.plans.add_site``, shared with the first-order reading of ``guards.sites``); a parameter
whose site fails is computed by its module's rule, as before.
"""

from __future__ import annotations

from curvopt.core.calls import Call
from curvopt.core.params import trainable
from curvopt.core.plans import add_site
from curvopt.core.records import token
from curvopt.core.state import STATE
from curvopt.engine.rows import reaches_own_samples
from curvopt.layers import rule_for
from curvopt.layers.parameter import RawParameter


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

    def computed(self) -> list:
        """``[(name, p)]``: the one parameter this call computes."""
        return trainable(self.module)


def with_sites(calls, walk, source, batched: bool, layout) -> dict:
    """``calls`` (``{record: [(output index, edge)]}`` of ``walk``, the walk of ``source``),
    with the :class:`SiteCall` of every raw parameter read at its site, verified on the
    structure's first pass by the probes on ``layout``'s rows (module doc); the owners'
    ``Record.sites`` bound."""
    if walk.plan is None or not walk.broadcasting:
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
            verdict = dict(walk.plan.sites).get(key)
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
