"""Curvature from one backward pass: square-root factors of the loss Hessian, propagated.

When the gradient reaches an extended loss (the first hook of a backward pass), the loss
supplies ``S`` with ``H_r = sum_k s_rk s_rk^T`` for every row ``r`` of its input (exact columns,
or Monte-Carlo columns from sampled targets). The rows are packed so that one propagated
column never holds two rows of the same sample (``layouts.RowLayout``); autograd propagates the
columns to the output of every extended module (``propagate``), giving ``V = J_y^T S`` there,
and each module turns ``V`` and its saved input into diagonals or Kronecker factors. Any graph
works: residual adds, functional ops, attention, reused modules.

:meth:`CurvaturePass.run` reads top to bottom: the row layout; the extensions grouped by the
source of their columns; per group, the loss's columns (:class:`LossColumns`: the square-root
factor in chunks within the memory budget ``_COLUMN_BUDGET``), the group's strategy
(:func:`choose`, from the walk: :class:`Direct`, or ``compress.HeadCut`` at a language model's
head) propagating them, and each chunk's propagated columns contributed (``diagonals``,
``kron_pass``) through the ``contribute(calls, outs)`` callback the strategy is given; then the
input-side factors, and the producers that walk on from the loss (``hessian``, ``kfra``).

The strategies (the pass itself holds no special case of propagation):

* :class:`Direct`: chunks of columns within the memory budget, packed by slot, each through
  ``propagate.to_calls`` from the loss input to every call at once (``V = J^T S``);
* ``compress.HeadCut``: the exact columns of a language model in two stages around the input
  ``h`` of its head, ``d`` per row below it instead of ``V`` (``compress``); it falls back to
  its :class:`Direct` where the probe columns show, on this pass, that the map from the loss
  input to ``h`` is not row-local.

:func:`choose` picks the strategy once per group and pass, from the walk: a cut is looked for
(``compress.find_cut``) only for the exact columns of a loss with one row dimension where some
position-wise call's input is narrower than a row's columns; whether one was found is kept in
the walk's plan (``core.plans.Plan.cuts``, by the loss input's shape, the columns per row and
whether diagonals are asked). A structure where none was found is not searched again (the
direct path is exact whatever the graph); one where a cut was found has it found again, on this
pass's nodes, with every condition of ``find_cut`` checked again, and ``HeadCut`` probes the
rows on every pass before any column goes. The other special cases of propagation are chosen
where the columns cross the graph, from the walk (``propagate``'s module doc): reentrant
checkpoints, max pooling and broadcast calls.

``EKFAC`` (eigenvalue-corrected curvature): the factors of its fresh bases are made here, with
the other Kronecker factors, and held in the result buffer; ``S`` is computed from each call's
inputs and output gradients in the module hooks that follow (``reducer``). The Kronecker
factors from each chunk of columns: ``kron_pass`` (the input side once per pass; from a
sub-batch, ``KFAC(samples=K)``: the propagated columns and inputs of the first ``K`` samples).

Coupled passes (a module that mixes samples, BatchNorm with batch statistics: ``layers.mixes``):
the curvature is that of the loss as computed, ``G = Jᵀ H J`` with ``J`` the Jacobian of the
whole batch's outputs, which couples samples. The Monte-Carlo columns ``s`` (``E[s sᵀ] = H``,
independent across samples) propagate through the coupled graph as they are, giving
``J^T s``; so ``ĝ_k = J_θᵀ s_k``, the batch gradient of the sampled loss, has
``E[ĝ ĝᵀ] = G`` and the diagonal is ``Σ_k ĝ_k²`` (``diagonals.batch_column_grads``; not a sum
of per-sample squares, which is biased when samples couple), a one-dimensional parameter's
block ``Σ_k ĝ_k ĝ_kᵀ`` (``kron_pass``), both unbiased; a weight's output side
``Σ_{k,rows} v vᵀ`` is unbiased for its coupled definition ``Σ_{n,p} J_npᵀ H J_np`` (``J_np``:
of all outputs w.r.t. the layer output at sample ``n``, position ``p``). The variance is that
of ``M = mc_samples`` draws: ``Var[ĝ_i²]/M = (2 G_ii² + κ_i)/M``, ``κ_i = 0`` for Gaussian
columns (``MSELoss``); one draw's relative standard deviation measured 1.3 (median) to 2.3
(max) for cross-entropy (``tests/test_batchnorm_expectation.py``). ``EKFAC``: the bases from
those factors, ``S = Σ_k (Q_0ᵀ Ĝ_k Q_1)²`` from the same ``ĝ_k`` (``kron_pass`` keeps them,
``reducer`` rotates them: unbiased for ``diag(Qᵀ G Q)``, not the empirical Fisher's diagonal of
an uncoupled pass), so its columns propagate with supplied bases too. The exact quantities of
the same producers take the exact columns of one row each (``RowLayout.singly``: ``R K``
columns, chunked by ``_COLUMN_BUDGET``; the loss Hessian is block-diagonal over rows, so
``G = Σ_{r,k} J^T s_rk s_rkᵀ J``): the same contributions are then exact, ``diag(G)``, the
one-dimensional blocks of ``G`` and ``B = Σ_n J_nᵀ H J_n``. Per-sample quantities (not
defined), ``DiagHessian`` and KFRA (``producers``: not ``coupled``) raise, naming the module.

That nothing outside the extended losses feeds the gradients (a term of the objective whose
curvature this would miss) is checked on every pass without propagating anything: hooks on the
graph's nodes compare the gradient each receives with what its consumers sent (``checks``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from functools import partial

import torch

from curvopt.engine.compress import HeadCut, find_cut
from curvopt.engine.diagonals import diagonals
from curvopt.engine.parameter_sites import with_sites
from curvopt.core.layouts import RowLayout
from curvopt.core.plans import add_cut
from curvopt.errors import BATCH_STATISTICS, UnsupportedLossError, module_error
from curvopt.engine.producers import TABLE, coupled_estimate
from curvopt.engine.loss_context import LossContext
from curvopt.layers import rule_for
from curvopt.losses import loss_rule_for
from curvopt.graph.propagate import loss_gradient, to_calls
from curvopt.engine.kron_pass import FactorStream
from curvopt.engine.rows import establish

#: bound on the elements of propagated columns held at once (all module outputs together):
#: a memory budget (32 MB in float32); chunks are exact, and they cost little time: autograd's
#: batched products gain little from more columns at once on large layers, and a call's
#: input-side Kronecker factor is computed once per pass whatever the chunks (``kron_pass``);
#: read on every pass (``LossColumns.fit``); the head's cut has its own (``compress``)
_COLUMN_BUDGET = 1 << 23


#: a quantity a pass through a module that mixes samples cannot give (``diagonals``: coupled):
#: its rule's reason, as for the per-sample quantities (one message whatever was asked for)
def _coupled(module) -> str:
    return rule_for(module).check(module) or BATCH_STATISTICS


def _fresh_bases(ext, calls, results) -> bool:
    """Whether the ``EKFAC`` extension ``ext`` needs this pass's factors for a parameter of
    ``calls`` (one without bases supplied for it, ``results.target(p)``)."""
    return any(
        ext.supplied(results.target(p)) is None for record in calls for _, p in record.computed()
    )


class CurvaturePass:
    """Second-order work of one loss of a backward pass, run from the loss hook: ``exts`` (the
    second-order extensions) contribute to ``results`` (the pass's ``results.ResultBuffer``);
    ``skip_diagonal``: a parameter without Kronecker factors gets its GGN diagonal instead
    (``collect(skip_unsupported=...)``)."""

    def __init__(self, results, exts, loss_record, weight: torch.Tensor, skip_diagonal=False):
        self.results = results
        self.loss = loss_record
        self.exts = exts
        self.skip_diagonal = skip_diagonal
        self.weight = float(weight)
        if self.weight < 0:
            raise UnsupportedLossError(
                "the loss enters the backward pass with a negative factor, so its "
                "Gauss-Newton matrix is not positive semi-definite. Backpropagate the loss "
                "scaled by a nonnegative factor."
            )
        self.scale = math.sqrt(self.weight)
        self.loss_input = loss_record.output.detach()  # the values the loss's rule reads

    def check(self, walk, per_sample: bool = False) -> None:
        """The loss's target and the calls of ``walk`` (``walk.Walk`` of its input) are
        supported; ``coupled`` where a call mixes samples, whose rule's reason is raised
        where the pass also wants ``per_sample`` (first-order) quantities. The loss's rule,
        looked up here, is the one :meth:`run` uses (``rule``), with the loss's divisor its
        check returns (``divisor``)."""
        module, target = self.loss.module, self.loss.target
        self.rule = loss_rule_for(module)
        self.divisor = self.rule.check(module, self.loss_input, target)  # (read once a pass)
        rules, mixer = [], None  # (module, rule, mixes samples), each rule looked up once
        for record in walk.calls:
            module = record.module
            rule = rule_for(module)
            mixing = rule.mixes_samples(module)
            if mixing and mixer is None:
                mixer = module
            rules.append((module, rule, mixing))
        self.coupled = mixer is not None  # the Monte-Carlo columns propagate through the batch
        if self.coupled and per_sample:
            raise module_error(mixer, _coupled(mixer))
        for ext in self.exts if self.coupled else ():
            if not coupled_estimate(ext):
                raise module_error(mixer, _coupled(mixer))
        for module, rule, mixing in rules:
            reason = None if mixing else rule.check(module)
            if reason is not None:
                raise module_error(module, reason)

    def run(self, walk) -> None:
        """All curvature of this loss, given ``walk`` (``walk.Walk`` of its input, its
        plan bound to this pass)."""
        output = self.loss.output
        rule, module, target = self.rule, self.loss.module, self.loss.target
        scale = rule.reduction_scale(module, self.loss_input, target, divisor=self.divisor)
        self.results.reduction_scale += self.weight * scale  # ``s``: the optimizers' damping
        calls, self.batched = walk.calls, walk.batchable
        self.walk = walk
        self.layout = establish(
            output, output.shape, calls, self.batched, walk, rule.elementwise, coupled=self.coupled
        )
        walks_on = any(TABLE[e.quantity.producer].walks for e in self.exts)
        if walk.broadcasting and not (self.coupled or walks_on):  # raw parameters at their sites
            calls = with_sites(calls, walk, output, self.batched, self.layout)
        self.factors = None  # made where the first chunk of columns for it arrives
        groups = defaultdict(list)
        for ext in self.exts:
            made = TABLE[ext.quantity.producer]
            if made.bases:
                self._note_reduction(ext)
                if not (self.coupled or _fresh_bases(ext, calls, self.results)):
                    continue  # every basis supplied: S from the module hooks alone
            if made.columns is None:
                continue
            key = (ext.source, ext.options["mc_samples"] if ext.source == "mc" else 0)
            groups[key].append(ext)
        for (source, mc_samples), exts in groups.items():
            self._propagate(rule, calls, exts, source, mc_samples)
        if self.factors is not None:
            self.factors.finish()
        walking = {made: [] for made in TABLE.values() if made.after is not None}  # in order
        for ext in self.exts:
            if TABLE[ext.quantity.producer] in walking:
                walking[TABLE[ext.quantity.producer]].append(ext)
        walking = {made: exts for made, exts in walking.items() if exts}
        if not walking:
            return
        exact = LossColumns(self, self.layout, "exact", 0)
        context = LossContext(output, walk, self.batched, exact.packed)
        for made, exts in walking.items():  # the table's: DiagHessian's residuals, then KFRA
            self.results.add(made.after(context, self.loss, self.weight, calls, exts))

    def _note_reduction(self, ext) -> None:
        """``EKFAC``'s scale is the divisor ``D`` of this pass's one loss (its rule's
        ``divisor``) and the factor the loss enters the backward with: note them, and check
        the reduction against the one ``ext`` expects (if it says)."""
        self.results.note_loss(self.loss, self.divisor, self.weight)
        expected, actual = ext.options["reduction"], getattr(self.loss.module, "reduction", None)
        if expected is not None and expected != actual:
            raise UnsupportedLossError(
                f"{ext!r} expects a loss with reduction={expected!r}, but "
                f"{type(self.loss.module).__name__} has reduction={actual!r}. Make them agree "
                "(optim.EKFAC: its reduction= argument, or None to take the loss's)."
            )

    def _propagate(self, rule, calls, exts, source, mc_samples) -> None:
        """One group's columns (``exts``, one ``source``): made, propagated by the group's
        strategy (:func:`choose`), turned into contributions."""
        kron_exts = [e for e in exts if TABLE[e.quantity.producer].columns == "factors"]
        diag_exts = [e for e in exts if e not in kron_exts]
        layout = self.layout
        if self.coupled and source == "exact":  # every row reaches every sample: one a column
            rows = math.prod(self.loss.output.shape[: layout.row_dims])
            layout = RowLayout.singly(rows, layout.row_dims, self.loss.output.device)
        columns = LossColumns(self, layout, source, mc_samples)
        strategy = choose(self.walk, calls, columns, self.batched, bool(diag_exts), self.coupled)
        contribute = partial(self._contribute, diag_exts=diag_exts, kron_exts=kron_exts)
        strategy.propagate(columns, contribute)

    def _contribute(self, calls, outs, diag_exts, kron_exts) -> None:
        """The contributions of one chunk's columns ``outs`` at the outputs of ``calls``."""
        if diag_exts:
            self.results.add(diagonals(calls, outs, diag_exts, coupled=self.coupled))
        if kron_exts:
            if self.factors is None:
                self.factors = FactorStream(
                    self.results, self.loss, self.layout, self.skip_diagonal, self.coupled
                )
            self.results.add(self.factors.contributions(calls, outs, kron_exts))

    def eigen_columns(self):
        """A coupled pass's ``(p, ext, gbar)`` for ``EKFAC``'s ``S``
        (``kron_pass.FactorStream.eigen_columns``; none where no Kronecker factor was asked)."""
        return () if self.factors is None else self.factors.eigen_columns()


class LossColumns:
    """The (scaled) square-root factor of one loss's Hessian from ``source`` (``"exact"``,
    ``"mc"`` with ``mc_samples`` draws, ``"empirical"``), in chunks, and how many of its
    columns fit the memory budget at once, for the loss of ``owner`` (its ``CurvaturePass``:
    the loss's rule, factor and divisor, read once a pass). ``root``: the loss input the
    columns start from; ``layout``: the pass's ``layouts.RowLayout``."""

    def __init__(self, owner: CurvaturePass, layout, source: str, mc_samples: int):
        self.loss, self.rule, self.scale, self.layout = owner.loss, owner.rule, owner.scale, layout
        self.divisor, self.loss_input = owner.divisor, owner.loss_input
        self.source, self.mc_samples = source, mc_samples
        self.root = owner.loss.output

    @property
    def budget(self) -> int:
        """Elements of propagated columns held at once (``_COLUMN_BUDGET``)."""
        return _COLUMN_BUDGET

    def per_row(self) -> int:
        """The exact factor's columns per row."""
        return self.rule.num_columns(self.loss.module, self.loss.output)

    def packed(self, chunk: int):
        """Chunks ``[k, *output.shape]`` of the (scaled) square-root factor, rows packed by
        slot for the exact factor (Monte-Carlo rows are independent draws: no packing; the
        empirical column, ``sqrt(c)`` times the loss gradient with ``c`` the reduction's
        divisor, holds every row: propagated, it sums each sample's rows)."""
        rule, loss = self.rule, self.loss
        module, output, target = loss.module, self.loss_input, loss.target
        if self.source == "mc":
            # (one name: the frame holds no unscaled factor while the columns are used)
            cols = self._scaled(
                rule.sqrt_hessian_mc(
                    module, output, target, self.mc_samples, check=False, divisor=self.divisor
                )
            )
            yield cols
            return
        if self.source == "empirical":
            yield loss_gradient(loss, self.scale * math.sqrt(self.divisor)).unsqueeze(0)
            return
        slots = self.layout.num_slots
        per_chunk = max(1, chunk // slots)
        for cols, _, _ in self._exact(per_chunk, min(slots, max(1, chunk))):
            yield cols

    def _exact(self, per_chunk: int, slot_chunk: int):
        """``(columns, first, stop)``: the exact factor's columns, ``per_chunk`` of them per
        row for the slots ``first:stop`` (at most ``slot_chunk``), packed by slot."""
        for cols in self.rows(per_chunk):
            for first in range(0, self.layout.num_slots, slot_chunk):
                stop = min(self.layout.num_slots, first + slot_chunk)
                yield self.layout.pack(cols, first, stop), first, stop

    def rows(self, per_chunk: int):
        """The exact factor's (scaled) columns ``[k, R, *F]``, ``per_chunk`` per row, every row
        in each (not packed)."""
        module, output, target = self.loss.module, self.loss_input, self.loss.target
        total = self.rule.num_columns(module, output)
        for start in range(0, total, per_chunk):
            columns = range(start, min(total, start + per_chunk))
            cols = self.rule.sqrt_hessian(
                module, output, target, columns=columns, check=False, divisor=self.divisor
            )
            cols = self._scaled(cols)  # (the frame then holds no unscaled copy while it is used)
            yield cols

    def _scaled(self, cols):
        """``cols`` (fresh from the rule) times ``scale``, the square root of the factor the loss
        enters the backward with: ``cols`` itself where that is 1 (the product is exact)."""
        return cols if self.scale == 1.0 else cols * self.scale

    def fit(self, calls, extra: int = 0, budget: int = 0) -> int:
        """Columns per chunk so that all propagated columns fit in ``budget`` elements
        (``_COLUMN_BUDGET`` by default; with ``extra`` elements per column besides the loss
        input and the calls' outputs)."""
        per_column = extra + self.loss.output.numel()
        for record, edges in calls.items():  # (a loop: a generator costs a call per step)
            numel = record.out_numel
            for index, _ in edges:
                per_column += numel[index]
        return max(1, (budget or _COLUMN_BUDGET) // per_column)


class Direct:
    """The columns in chunks (as many as fit ``columns.fit(calls)``), each from the loss input
    to every call of ``calls`` in one ``propagate.to_calls``."""

    def __init__(self, calls, batched: bool, walk):
        self.calls, self.batched, self.walk = calls, batched, walk

    def propagate(self, columns, contribute) -> None:
        calls = self.calls
        for cols in columns.packed(columns.fit(calls)):
            # (no name holds a chunk's propagated columns while the next one's are made)
            outs = to_calls(columns.root, calls, cols, self.batched, self.walk)
            contribute(calls, outs)
            del outs, cols


def choose(walk, calls, columns, batched: bool, diagonals: bool, coupled: bool = False):
    """The strategy for ``columns`` (``curvature.LossColumns``) to ``calls`` of ``walk``:
    ``compress.HeadCut`` where a cut is found (module doc), else :class:`Direct` (always in a
    ``coupled`` pass); ``diagonals``: diagonal quantities are asked (a weight tied across the
    cut forbids it)."""
    direct = Direct(calls, batched, walk)
    if columns.source != "exact" or columns.layout.row_dims != 1 or coupled:
        return direct
    root, total = columns.root, columns.per_row()
    key = (tuple(root.shape), total, diagonals)
    known = None if walk.plan is None else dict(walk.plan.cuts).get(key)
    if known is False:
        return direct
    cut = find_cut(walk, calls, root, diagonals) if _narrower(calls, total) else None
    if cut is not None and total <= cut.width:
        cut = None  # no fewer columns below the head than in a row
    if known is None:
        add_cut(walk, key, cut is not None)
    return direct if cut is None else HeadCut(cut, calls, batched, walk, direct)


def _narrower(calls, total: int) -> bool:
    """Whether a position-wise call's input is narrower than the loss's ``total`` exact columns
    per row: only there can columns be compressed (``compress``; the cut is such an input)."""
    return any(
        record.positionwise
        and record.args
        and isinstance(record.args[0], torch.Tensor)
        and record.args[0].shape[-1] < total
        for record in calls
    )
