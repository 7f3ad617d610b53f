"""The first-order reducer: per-sample gradients from the layer rules, reduced for the
first-order quantities (``FirstOrderReducer``); and the reductions materialised chunk by chunk
where a rule has no fast path (``reduce_in_chunks``, also used by the gradient-sum checks).

``EKFAC``'s ``S = c · Σ_n (Q_0ᵀ G_n Q_1)²`` is a reduction of the per-sample gradients too, in
an eigenbasis (supplied, or that of this pass's factors from the loss hook, ``results.basis``):
each call's from its rule (``LayerRule.eigen_correction``), a parameter used by several calls
from its materialised per-sample gradients; ``c = D``, the divisor of the pass's loss
(``results.divisor``: ``N`` for one term per sample, the counted rows of a flattened sequence
loss, ``N K`` for ``MSELoss("mean")`` with ``K`` outputs, 1 for ``"sum"``), so that ``S`` is on
the GGN's scale.

In a coupled pass (a module mixing samples, BatchNorm in training mode: ``curvature``) there
are no per-sample gradients; ``S`` is then the Monte-Carlo estimate
``S = Σ_k (Q_0ᵀ Ĝ_k Q_1)²`` (:meth:`FirstOrderReducer.correct_columns`), ``Ĝ_k`` the batch
gradient of the sampled column ``k`` (``ĝ_k = J_θᵀ s_k``, ``diagonals.batch_column_grads``,
the coupled diagonal's, as a ``[dim Q_0, ·]`` matrix), scale 1: the columns carry the loss's
``1/D`` and its factor ``w`` already, and ``E[s_k s_kᵀ] = H`` (``mc_samples`` columns each
``1/√M``) makes ``E[Σ_k ĝ_k ĝ_kᵀ] = G``, so ``E[S] = diag(Qᵀ G Q)`` for bases ``Q`` fixed
(supplied; fresh bases come from the same columns, as the uncoupled ones come from the same
batch). It differs from the uncoupled ``S``, ``diag(Qᵀ EF Q)`` of the empirical Fisher at the
observed targets, which equals ``diag(Qᵀ G Q)`` only in expectation over targets drawn from the
model: the coupled ``S`` estimates the GGN's diagonal in the basis, the targets not used. Its
variance is that of the coupled diagonal (``curvature``), entry by entry in the basis: one
column's relative standard deviation about ``√2`` for Gaussian columns. With exact factors
(``factors="kflr"``) the columns are the exact ones of one row each, ``Σ_k ĝ_k ĝ_kᵀ = G``, and
``S = diag(Qᵀ G Q)`` exactly."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from curvopt.core.buffers import empty_result
from curvopt.errors import UnsupportedModuleError
from curvopt.engine.producers import TABLE
from curvopt.layers.eigenbasis import eigen_moment_of
from curvopt.core.passgrad import gradient
from curvopt.core.reductions import dense_gradient, squared_norms, sum_of_squares
from curvopt.engine.results import name_of

#: elements per chunk when per-sample gradients are materialised only to be reduced
_CHUNK_ELEMENTS = 1 << 20


def reduce_in_chunks(rule, call, name, shape, want):
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


class FirstOrderReducer:
    """The first-order producers of one pass: per-sample gradients ``g_n`` of every module call
    and their reductions, put into the result buffer for each attribute a producer writes
    (``MOMENTS``: ``(sum g^2, sum g)``, turned into a variance by ``accumulate``). Each call's
    ``sum_n g_n`` (or its projection through the pass's ``probes``, ``engine.probes``) is handed
    to the ``observers`` (the sum checks, ``guards.checks``, which only compare: set by the
    pass, :meth:`add_total`); each parameter's gradient of the pass comes from the pass
    (:meth:`parameter_grad`). ``EKFAC``'s eigen-corrected moments are made here too (from the
    module hooks of a second-order pass)."""

    def __init__(self, extensions, results, probes):
        #: the ``EKFAC`` extensions
        self.corrected = [e for e in extensions if TABLE[e.quantity.producer].bases]
        #: producer's implementation (``producers.TABLE``) -> the attributes it writes (from
        #: each quantity's declaration), in the table's order
        self.first: Dict[object, list] = {}
        for made in TABLE.values():
            for ext in extensions:
                if TABLE[ext.quantity.producer] is made and (ext.order == 1 or made.bases):
                    self.first.setdefault(made, []).append(ext.attr)
        # (what follows from the producers, read in one loop: a comprehension or generator
        # costs a call each, and this runs every pass)
        #: (reductions, attributes) of each producer made of reductions, in the table's order
        self._stored: list = []
        #: the attributes of the per-sample gradients (``None``: not kept); ``couple`` leaves it
        self._kept = None
        #: a producer needs per-sample gradients in any pass (``EKFAC``'s not in a coupled
        #: one; :meth:`couple` removes only producers with bases, so it leaves this)
        self.per_sample = False
        wanted: set = set()
        for made, attrs in self.first.items():
            if made.reduces:
                self._stored.append((made.reduces, attrs))
                wanted.update(made.reduces)
            if self._kept is None and made.reduces == ("batch",):
                self._kept = attrs
            if not made.bases:
                self.per_sample = True
        #: what the reductions want, fixed for the pass (no table lookup per parameter)
        self.want_l2 = "l2" in wanted
        self.want_sgs = "sgs" in wanted
        self.want_moments = "total" in wanted
        #: a producer computed from the per-sample gradients without keeping them
        self.reduces = self.want_l2 or self.want_sgs
        #: the per-sample gradients are kept (plain attributes, fixed for the pass: read per
        #: module call, and by the loss hook without a call into this module)
        self.keeps_per_sample = self._kept is not None
        self.results, self.probes = results, probes
        #: ``observe(p, use, total, projected)`` of each sum check (``add_total``)
        self.observers: list = []
        self.grads: Dict[int, torch.Tensor] = {}  # id(p): p's gradient of the pass
        self.batch_grads: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}  # id(p): p, [N, *p]
        #: (p, sum_n g_n**2, rule, call, name) whose moments take ``sum_n g_n`` from ``p``'s
        #: gradient of the pass (checked equal to it)
        self.moments_from_grad: List[tuple] = []

    def couple(self) -> None:
        """The pass is coupled (``curvature``): ``EKFAC``'s ``S`` comes from the loss hook's
        columns (:meth:`correct_columns`), not from the module hooks' per-sample gradients,
        which do not exist."""
        for made in [made for made in self.first if made.bases]:
            del self.first[made]  # in place: the pass reads this dict (``backward``)

    def correct_columns(self, columns) -> None:
        """A coupled pass's ``p.ekfac = [Σ_k (Q_0ᵀ Ĝ_k Q_1)², *bases]`` from ``columns``,
        ``(p, ext, ĝ [K, *p.shape])`` (``kron_pass.FactorStream.eigen_columns``), unscaled:
        unbiased for ``diag(Qᵀ G Q)`` (the module docstring)."""
        for p, ext, grads in columns:
            bases = self._bases(ext, p)
            if bases is not None:
                self.results.put(p, ext.attr, [eigen_moment_of(grads, bases), *bases])

    def add(self, p, rule, call, name, materialise: bool, sums: bool = True) -> None:
        """One call's contribution for ``p``: added into ``[N, *p.shape]`` (``materialise``: the
        per-sample gradients are wanted, or ``p`` is used by several calls) or reduced at once.
        ``sums``: the checks compare this call's ``sum_n g_n`` (:meth:`add_total`); ``False``
        only where no producer of the pass reduces the per-sample gradients (``per_sample``:
        ``EKFAC``'s ``S`` alone) and the structure's sums were checked (``guards.checks``)."""
        if materialise:
            self._accumulate(p, rule, call, name)
            for ext in self.corrected:  # S follows from the sum at the end (``finish``)
                if self._bases(ext, p) is not None:
                    self.results.put(p, ext.attr, None)
        else:
            if sums:  # (else ``S`` alone: no reduction is read, only the checks' sum)
                self._reduce(p, rule, call, name)
            if self.corrected:  # (EKFAC's)
                self._correct(p, lambda bases: rule.eigen_correction(call, name, bases))

    def add_total(self, p, rule, call, name, total=None) -> Optional[torch.Tensor]:
        """This call's ``sum_n g_n`` for the checks, returned: ``total`` (from per-sample
        gradients made anyway), else seen through the pass's random probes where that is
        cheaper (``rule.projected_sum``, returning ``None``), else by the rule's ``grad_sum``
        or in chunks. Each observer gets ``(p, (rule, call, name), total, projected)``, with
        ``projected = (probes, [K] projected sum, magnitude)`` where the sum was projected
        (``total`` then ``None``)."""
        use = (rule, call, name)
        if total is None and self.probes.projects(p):
            probes = self.probes.of(p)
            projected = rule.projected_sum(call, name, *probes)
            if projected is not None:
                for observe in self.observers:
                    observe(p, use, None, (probes, *projected))
                return None
        if total is None:
            total = rule.grad_sum(call, name)
        if total is None:
            total = reduce_in_chunks(rule, call, name, p.shape, {"grad_sum": True})["grad_sum"]
        for observe in self.observers:
            observe(p, use, total, None)
        return total

    def parameter_grad(self, p, kept) -> None:
        """``p``'s whole gradient of this pass (``MOMENTS``' ``sum_n g_n`` where the sum was
        projected, :meth:`finish`), as ``passgrad.held`` kept it (no copy by autograd)."""
        self.grads[id(p)] = kept

    def _accumulate(self, p, rule, call, name) -> None:
        found = self.batch_grads.get(id(p))
        if found is not None:
            found[1].add_(rule.batch_grad(call, name))
            return
        like = call.first_grad
        shape = (like.shape[call.batch_dim], *p.shape)  # (``call.batch_size``)
        kept = self._kept
        if kept:
            buffer = empty_result(p, kept[0], shape, like)
        else:
            buffer = torch.empty(shape, dtype=like.dtype, device=like.device)
        self.batch_grads[id(p)] = (p, rule.batch_grad(call, name, out=buffer))

    def _reduce(self, p, rule, call, name) -> None:
        """Reduced quantities of a parameter used once, via fast paths where the rule has them.
        Where per-sample gradients are materialised in chunks anyway, their sum is the total
        checked against ``p``'s whole gradient (checking them too); else the projected or full
        sum of ``add_total``. A projected sum leaves ``MOMENTS``' ``sum_n g_n`` to ``p``'s
        gradient of the pass, which the check proves equal to it (``finish``)."""
        want_l2, want_sgs = self.want_l2, self.want_sgs
        l2 = rule.batch_l2(call, name) if want_l2 else None
        sgs = rule.sum_grad_squared(call, name) if want_sgs else None
        missing = {"l2": want_l2 and l2 is None, "sgs": want_sgs and sgs is None}
        if any(missing.values()):
            chunked = reduce_in_chunks(rule, call, name, p.shape, {**missing, "grad_sum": True})
            l2 = chunked.get("l2", l2)
            sgs = chunked.get("sgs", sgs)
            total = chunked["grad_sum"]
        else:
            total = None
        total = self.add_total(p, rule, call, name, total)
        if total is None and self.want_moments:
            self.moments_from_grad.append((p, sgs, rule, call, name))
        self._store(p, {"l2": l2, "sgs": sgs, "total": total})

    def finish(self) -> None:
        """The materialised per-sample gradients and their reductions, into the buffer (and
        the moments whose ``sum_n g_n`` is ``p``'s gradient of the pass, checked equal)."""
        for p, sgs, rule, call, name in self.moments_from_grad:
            grad = self.grads.get(id(p))
            if grad is not None:
                total = dense_gradient(gradient(grad)).to(sgs.dtype, copy=True)
            else:  # no gradient accumulated (nothing checked against): the sum itself
                total = rule.grad_sum(call, name)
                if total is None:
                    total = reduce_in_chunks(rule, call, name, p.shape, {"grad_sum": True})
                    total = total["grad_sum"]
            self._store(p, {"sgs": sgs, "total": total}, made_of="total")
        self.moments_from_grad.clear()
        for p, batch in self.batch_grads.values():
            self._store(p, {"batch": batch})
            if self.reduces:
                l2 = squared_norms(batch) if self.want_l2 else None
                sgs = sum_of_squares(batch) if self.want_sgs else None
                total = batch.sum(0) if self.want_moments else None
                self._store(p, {"l2": l2, "sgs": sgs, "total": total})
            if self.corrected:  # (EKFAC's)
                self._correct(p, lambda bases, batch=batch: eigen_moment_of(batch, bases))

    def clear(self) -> None:
        """The pass ended: drop the per-sample gradients, gradients and probes it holds."""
        self.batch_grads.clear()
        self.grads.clear()
        self.probes.clear()

    def _correct(self, p, moment) -> None:
        """``p.ekfac = [c · moment(bases), *bases]`` for every ``EKFAC`` extension, ``c`` the
        loss's divisor ``D`` over the factor ``w`` the loss enters the backward with, so that
        ``S`` is linear in ``w`` as the GGN is (``G_n`` carries ``w``, its square ``w²``): a
        loss divided by the accumulation steps, or a sum divided by a count, scales ``S`` as it
        scales the loss."""
        for ext in self.corrected:
            bases = self._bases(ext, p)
            if bases is None:
                continue
            self.results.put(p, ext.attr, [moment(bases).mul_(self.results.divisor), *bases])

    def _bases(self, ext, p):
        """``p``'s bases for ``ext``: supplied (for the parameter its results go to, checked),
        or this pass's; ``None`` where ``p`` is skipped (``collect(skip_unsupported=True)``)."""
        bases = ext.supplied(self.results.target(p))
        if bases is not None:
            return _checked(p, list(bases))
        bases = self.results.basis(p, ext.attr)
        if bases is None and (id(p), ext.attr) not in self.results.skipped:
            raise UnsupportedModuleError(
                f"curvopt: parameter {name_of(p)!r} received a gradient but no Kronecker "
                "factors for its EKFAC basis (the extended loss does not reach its module's "
                "output). Supply its bases, EKFAC(bases={param: [Q_0, Q_1]})."
            )
        return bases

    def _store(self, p, reductions: dict, made_of: Optional[str] = None) -> None:
        """The values made of ``reductions`` (name -> tensor, ``None`` where not made) into the
        buffer, for every attribute each producer writes (copies beyond the first): each
        producer whose reductions (``Implementation.reduces``) are all there, and use
        ``made_of`` where given (``MOMENTS``' total found at the end of the pass)."""
        for needs, attrs in self._stored:
            if made_of is not None and made_of not in needs:
                continue
            values = []
            for name in needs:
                value = reductions.get(name)
                if value is None:
                    break
                values.append(value)
            else:
                value = values[0] if len(values) == 1 else tuple(values)
                for i, attr in enumerate(attrs):
                    self.results.put(p, attr, value if i == 0 else _copy(value))


def _checked(p, bases):
    """Supplied ``bases``: at most one orthogonal matrix per side of ``p`` as a ``[p.shape[0],
    ·]`` matrix (``[]`` for a 0-dim ``p``), square and of that side's size; or stacked per
    group, ``[G, d, d]`` each (a grouped convolution's: ``p`` as ``G`` matrices
    ``[p.shape[0] / G, ·]``)."""
    sizes = [p.shape[0], p[0].numel()] if p.dim() > 1 else list(p.shape)
    expected = [(s, s) for s in sizes]
    stacked = {q.shape[0] for q in bases if isinstance(q, torch.Tensor) and q.dim() == 3}
    if len(stacked) == 1 and sizes and sizes[0] % min(stacked) == 0:
        groups = min(stacked)
        expected = [(groups, s, s) for s in [sizes[0] // groups, *sizes[1:]]]
    ok = len(bases) <= len(sizes) and all(
        isinstance(q, torch.Tensor) and tuple(q.shape) == shape for q, shape in zip(bases, expected)
    )
    if not ok:
        shapes = [
            tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__ for q in bases
        ]
        raise ValueError(
            f"EKFAC: the bases supplied for parameter {name_of(p)!r} (shape {tuple(p.shape)}) "
            f"are {shapes}. Supply square matrices of sizes {sizes} (or a prefix of them)."
        )
    return bases


def _copy(value):
    """A copy of a result (a tensor or a tuple of them), so that two attributes never alias."""
    return tuple(v.clone() for v in value) if isinstance(value, tuple) else value.clone()
