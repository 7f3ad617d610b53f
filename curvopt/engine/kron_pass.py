"""Kronecker factors from the columns propagated in one loss's curvature pass (``curvature``).

Each chunk of columns that reaches a call gives the output side of its factors (summed into
the result buffer over chunks and losses); the input side, which does not depend on the
columns, is computed once, after the last chunk (:meth:`FactorStream.finish`: no propagated
columns are held then, and no chunk is propagated while the large input-side factors are).
``KFAC(samples=K)``: the factors of the first ``K`` samples, the columns scaled so that the
output side estimates the whole batch's; a parameter without a factorisation
(``skip_unsupported="diagonal"``) gets the GGN diagonal of those same scaled columns,
``c sum_{n<K} sum_k (J_n^T v_nk)**2``, an estimate of the whole batch's at the same scale
``c`` (``EKFAC``'s extension too: the diagonal of the columns its bases come from). A
``coupled`` pass (columns through a module mixing samples, ``curvature``): a one-dimensional
parameter's block is ``sum_k gbar_k gbar_k^T`` and the fallback diagonal ``sum_k gbar_k**2``,
``gbar_k = sum_n J_n^T v_nk`` the batch gradient of column ``k`` (whole batch, ``samples=K`` or
not), unbiased for the exact block; the output side of a factored weight is unchanged,
``sum_{k,rows} v v^T``, unbiased for its coupled definition (Monte-Carlo columns; exact for the
exact columns of one row each); ``EKFAC``'s ``gbar_k`` (summed over
the calls using the parameter, supplied bases or fresh) are kept for its ``S``
(:meth:`FactorStream.eigen_columns`, rotated by ``reducer``)."""

from __future__ import annotations

import math
from functools import cache, partial

import torch

from curvopt.engine.diagonals import batch_column_grads, diag_from_columns, narrow
from curvopt.engine.results import Factors, Term
from curvopt.errors import UnsupportedKroneckerError
from curvopt.engine.producers import TABLE
from curvopt.layers import rule_for
from curvopt.layers.kron import grouped_gram, kron_factors
from curvopt.losses import loss_rule_for


class FactorStream:
    """The Kronecker contributions of one loss (``loss``, its rows laid out by ``layout``) into
    ``results``; ``skip_diagonal``: an unsupported parameter gets its GGN diagonal instead."""

    def __init__(self, results, loss, layout, skip_diagonal: bool, coupled: bool = False):
        self.results = results
        self.coupled = coupled  # the columns went through a module mixing samples (``diagonals``)
        self.loss = loss
        self.layout = layout
        self.skip_diagonal = skip_diagonal
        self._sub_batch_roots = {}  # K -> the root of the output side's scale (``samples=K``)
        #: the input sides still to compute: (the call without its output gradient, name,
        #: approx, n, the factors the result buffer holds, the input side's index)
        self._inputs: list = []
        #: ``coupled``: (id(p), attr) -> (p, the ``EKFAC`` extension, {chunk: ``[K, *p]``})
        self._columns: dict = {}
        self._chunks = 0  # the chunks of columns added so far

    def eigen_columns(self):
        """``coupled``: ``(p, ext, gbar)`` for every parameter of an ``EKFAC`` extension
        ``ext``, ``gbar [K, *p]`` the batch gradients of all its columns (every chunk's)."""
        for p, ext, chunks in self._columns.values():
            yield p, ext, torch.cat(list(chunks.values()))

    def _keep_columns(self, p, ext, grads) -> None:
        """One call's batch gradients ``grads`` of this chunk's columns for ``p``'s ``EKFAC``
        ``S``, summed with those of the other calls using ``p`` (never in place: a factor's
        ``gram`` root may hold them)."""
        chunks = self._columns.setdefault((id(p), ext.attr), (p, ext, {}))[2]
        old = chunks.get(self._chunks)
        chunks[self._chunks] = grads if old is None else old + grads

    def contributions(self, calls, outs, kron_exts):
        """The ``Factors`` of ``kron_exts`` from one chunk of columns ``outs`` at every call, one
        call's at a time, for the result buffer to add as they come (each added before the next
        is computed; a parameter without a factorisation: skipped, or its diagonal ``Term``;
        ``EKFAC``'s fresh bases: noted)."""
        for record in calls:
            call, columns, n = record.column_call(outs[record])
            if call is None:
                continue
            rule = rule_for(call.module)
            for name, p in record.computed():
                # ``coupled``: the batch gradients of the columns, made once where wanted
                # (every use is in a coupled pass)
                column_grads = (
                    cache(partial(batch_column_grads, call, columns, name, n))
                    if self.coupled
                    else None
                )
                for ext in kron_exts:
                    basis = TABLE[ext.quantity.producer].bases
                    if basis and self.coupled:  # its S: from these (``reducer``)
                        self._keep_columns(p, ext, column_grads())
                    if basis and ext.supplied(self.results.target(p)) is not None:
                        continue
                    approx = ext.options["kfac_approx"]
                    first = not self.results.has_factors(p, ext.attr, record, basis)
                    sub, cols, k = self._sub_batch(call, columns, n, ext)
                    try:
                        if self.coupled and p.dim() == 1:  # the whole batch's block, unbiased
                            groups = rule.kron_groups(call.module, name)
                            factors = [grouped_gram(column_grads(), groups)]
                        else:
                            factors = kron_factors(sub, cols, name, p, approx, k)
                    except UnsupportedKroneckerError as error:
                        self.results.skip(p, ext.attr, error, record)
                        if self.skip_diagonal:  # of the same (sub-)batch
                            if self.coupled:
                                d = column_grads().square().sum(0)
                            else:
                                d = diag_from_columns(rule, sub, cols, name, p, False, k)
                            yield Term(p, ext.fallback.attr, d)
                        continue
                    index = rule.output_factor_index(name)
                    if first and len(factors) == 2:  # the input side: from ``finish``
                        inputs = sub.without_grad()  # not the columns
                        self._inputs.append((inputs, name, approx, k, factors, 1 - index))
                    contribution = Factors(p, ext.attr, record, factors, index)
                    if basis:  # EKFAC's fresh basis: S follows in the module hooks (reducer)
                        self.results.add_basis(contribution)
                    else:
                        yield contribution
        self._chunks += 1  # (the chunk is consumed whole: the result buffer adds every one)

    def finish(self) -> None:
        """The input side of every call's first contribution (it holds ``None`` there until
        now; the result buffer holds that same list)."""
        inputs, self._inputs = self._inputs, []
        for call, name, approx, n, factors, index in inputs:
            factors[index] = rule_for(call.module).kron_input_factor(call, name, approx, n)

    def _sub_batch(self, call, columns, n, ext):
        """``(call, columns, n)`` of the first ``K`` samples for an extension with
        ``samples=K < n`` (the columns times the root of :meth:`_sub_batch_root`, so that the
        output-side factor, and its ``gram_root``, carry the scale); as given otherwise."""
        k = ext.options.get("samples")
        if k is None or k >= n:
            return call, columns, n
        if k not in self._sub_batch_roots:
            self._sub_batch_roots[k] = self._sub_batch_root(k)
        root = self._sub_batch_roots[k]
        cols = narrow(columns, 0, k, dim=1 + call.batch_dim)
        if isinstance(cols, torch.Tensor):
            return call.slice(0, k), cols * root, k
        return call.slice(0, k), tuple(None if c is None else c * root for c in cols), k

    def _sub_batch_root(self, k: int) -> float:
        """``sqrt(c)``, ``c`` the scale that makes the output side of the first ``k`` samples'
        factors estimate the whole batch's: ``N / k`` for ``reduction="sum"``, ``D / D_k``
        for ``"mean"`` (``D`` the loss's divisor, ``D_k`` that of the rows of the first ``k``
        samples, ``layouts.RowLayout.first``: the sub-batch's own mean); 0 where those rows
        hold no term of the loss (all ignored)."""
        module, output, target = self.loss.module, self.loss.output.detach(), self.loss.target
        if module.reduction == "sum":
            return math.sqrt(self.layout.samples / k)
        rule = loss_rule_for(module)
        try:
            part = rule.divisor(module, *self.layout.first(k, output, target))
        except ValueError:  # no term of the loss in those rows: their columns vanish
            return 0.0
        return math.sqrt(rule.divisor(module, output, target) / part) if part else 0.0
