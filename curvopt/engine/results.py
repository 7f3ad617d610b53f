"""The result buffer of one backward pass: contributions collected, written when it ends.

Lower layers (``diagonals``, ``hessian``, ``kfra``, the first-order reducer) return their
results as contributions; the buffer is the one place that collects them:

* :class:`Term` ``(p, attr, value)``: added to the pending ``p.<attr>`` (diagonals summed over
  column chunks, losses and residual terms; the first contribution is kept as the buffer);
* :class:`Factors` ``(p, attr, record, factors, out_index)``: the Kronecker factors of one
  module call. The output-side factor sums over column chunks and losses of that call; several
  calls using ``p`` (a reused module, a weight tied across modules, two losses on different
  inputs) are combined when the pass ends into the nearest Kronecker product of their sum
  (``values.KroneckerFactors.of_uses``, which keeps each call's factors, so that the passes
  combine use by use); a quantity declared ``Combine.RAISES`` (KFRA, whose recursion is for
  chains) raises instead.
* the Kronecker factors of a parameter's fresh ``EKFAC`` basis (:meth:`ResultBuffer.add_basis`),
  collected like :class:`Factors` but never written: :meth:`ResultBuffer.basis` gives their
  eigenvectors to the reducer, which computes ``S`` in the module hooks (the loss hook, where
  the factors are made, runs first). ``EKFAC``'s scale depends on the reduction of the pass's
  loss (:meth:`ResultBuffer.note_loss`: one extended loss per pass).

:meth:`ResultBuffer.write` makes the pending values typed (``values``: the Kronecker factors
knowing their output side, ``[S, *bases]``), combines them with the earlier passes of the same
``collect`` (``accumulate``) and sets them as attributes; nothing is written before. It
returns the parameters written for: the pass leaves no earlier value on the others of its
models (``accumulate.Accumulator.leave``).
"""

from __future__ import annotations

from typing import Dict, Iterable, NamedTuple, Tuple

import torch

from curvopt.errors import UnsupportedLossError, module_error
from curvopt.extensions.quantity import Combine, quantity
from curvopt.core.extended import module_path, path_of
from curvopt.core.psd import psd_eigh
from curvopt.core.reductions import gram_add_
from curvopt.core.values import KroneckerFactors, typed


class Term(NamedTuple):
    p: torch.Tensor
    attr: str
    value: torch.Tensor


class Factors(NamedTuple):
    p: torch.Tensor
    attr: str
    record: object
    factors: list
    out_index: int


def name_of(p) -> str:
    return path_of(p, f"of shape {tuple(p.shape)}")


def _combined(uses) -> KroneckerFactors:
    """The factors of the calls ``uses`` (``record -> (factors, out_index)``) together
    (``KroneckerFactors.of_uses``), each call named by its module's path, and ``#k`` for its
    ``k``-th call of the pass (``k > 1``)."""
    if len(uses) == 1:  # (one call: its own factors, which ``of_uses`` names no call of)
        ((factors, out_index),) = uses.values()
        return KroneckerFactors(factors, out_index)
    named, seen = {}, {}
    for record in sorted(uses, key=lambda r: r.seq):  # forward order
        path = module_path(record.module)
        seen[path] = seen.get(path, 0) + 1
        factors, out_index = uses[record]
        named[path if seen[path] == 1 else f"{path}#{seen[path]}"] = KroneckerFactors(
            factors, out_index
        )
    return KroneckerFactors.of_uses(named)


def _add_use(uses: dict, c: Factors) -> bool:
    """Add ``c`` into ``uses``: summed into the output-side factor of a call already there
    (another column chunk or loss), else stored; whether ``c.record`` is new."""
    if c.record in uses:
        gram_add_(uses[c.record][0][c.out_index], c.factors[c.out_index])
        return False
    uses[c.record] = (c.factors, c.out_index)
    return True


class ResultBuffer:
    """Pending ``p.<attr>`` values of one pass, and the parameters left out
    (``collect(skip_unsupported=...)``: ``skip_into`` receives their names and reasons)."""

    def __init__(self, skip_into=None):
        self.skip_into = skip_into
        self.pending: Dict[Tuple[int, str], Tuple[torch.Tensor, object]] = {}
        self.kron_uses: Dict[Tuple[int, str], dict] = {}  # (id(p), attr): {call: factors}
        self.skipped: Dict[Tuple[int, str], Tuple[str, str]] = {}  # (id(p), attr): name, why
        self.skipped_calls: Dict[Tuple[int, str], object] = {}  # (id(p), attr): its record
        self.basis_uses: Dict[Tuple[int, str], dict] = {}  # (id(p), attr): {call: factors}
        self.bases: Dict[Tuple[int, str], list] = {}  # (id(p), attr): eigenvectors
        self.loss = None  # the loss record of an EKFAC pass (note_loss)
        #: the scale ``c`` of EKFAC's ``S``: its divisor ``D`` over the factor ``w`` the loss
        #: enters the backward with
        self.divisor = None
        #: FSDP2: ``id(gathered)`` -> the sharded parameter written for it (``core.sharded``)
        self.sharded: Dict[int, torch.Tensor] = {}
        #: ``s = Σ_l w_l N_l / D_l`` over the pass's extended losses (``LossRule.reduction_scale``
        #: times the factor ``w_l`` each enters the backward with), handed to the accumulator
        #: with the values (:meth:`write`)
        self.reduction_scale = 0.0

    def target(self, p) -> torch.Tensor:
        """The parameter ``p``'s results are written on: its sharded parameter where FSDP2
        gathered ``p`` for the computation, else ``p`` (the one an optimizer holds, and
        supplies ``EKFAC``'s bases for)."""
        return self.sharded.get(id(p), p)

    def put(self, p, attr: str, value) -> None:
        """``p.<attr> = value`` when the pass has finished."""
        self.pending[(id(p), attr)] = (p, value)

    def add(self, contributions: Iterable) -> None:
        """Collect :class:`Term` and :class:`Factors` contributions, in order."""
        for c in contributions:
            if isinstance(c, Factors):
                self._add_factors(c)
            else:
                old = self.pending.get((id(c.p), c.attr))
                if old is None:
                    self.put(c.p, c.attr, c.value)
                else:
                    old[1].add_(c.value)

    def _add_factors(self, c: Factors) -> None:
        key = (id(c.p), c.attr)
        uses = self.kron_uses.setdefault(key, {})
        if c.record not in uses and uses and quantity(c.attr).combine is Combine.RAISES:
            raise module_error(
                c.record.module,
                "KFRA: a module used several times in one backward pass (or a weight tied "
                "across modules) breaks the layer chain. Use KFLR or KFAC; see "
                "docs/support.md#kfra.",
            )
        if not uses:
            self.put(c.p, c.attr, None)
        _add_use(uses, c)

    def has_factors(self, p, attr: str, record, basis: bool) -> bool:
        """Whether ``record``'s factors of ``p.<attr>`` (``EKFAC``'s fresh basis: ``basis``)
        are already here (from an earlier chunk of columns or loss): a further contribution
        needs its output side alone."""
        uses = (self.basis_uses if basis else self.kron_uses).get((id(p), attr), ())
        return record in uses

    def add_basis(self, c: Factors) -> None:
        """The factors of one call for ``p``'s fresh ``EKFAC`` basis (never written)."""
        _add_use(self.basis_uses.setdefault((id(c.p), c.attr), {}), c)

    def basis(self, p, attr: str):
        """``[Q_0, Q_1]``: the eigenvectors (``psd_eigh``) of ``p``'s factors of this pass
        (several calls: their nearest Kronecker product, as ``kfac`` writes), or ``None``."""
        key = (id(p), attr)
        if key not in self.bases:
            uses = self.basis_uses.get(key)
            if not uses:
                return None
            factors = _combined(uses)
            for index, factor in enumerate(factors):
                if not bool(factor.isfinite().all()):
                    raise FloatingPointError(
                        f"EKFAC: the Kronecker factor {index} of parameter {name_of(p)!r} is not "
                        "finite (its inputs or output gradients overflowed), so it has no "
                        "eigenbasis. Check the loss, the learning rate and the input scale."
                    )
            self.bases[key] = [psd_eigh(f)[1] for f in factors]
        return self.bases[key]

    def note_loss(self, record, divisor: float, weight: float = 1.0) -> None:
        """The extended loss of an ``EKFAC`` pass, its divisor ``D`` and the factor ``w`` it
        enters the backward pass with: ``S``'s scale is ``D / w`` (linear in ``w``, as the
        GGN; ``grad_batch`` carries ``w``). One loss per pass (the per-sample gradients of two
        losses mix two scalings)."""
        if self.loss is not None and self.loss is not record:
            raise UnsupportedLossError(
                f"EKFAC: one backward pass runs through two extended losses "
                f"({type(self.loss.module).__name__}, {type(record.module).__name__}), whose "
                "scalings mix in the per-sample gradients. Backpropagate each loss in its own "
                "pass, or add them into one loss module; see "
                "docs/support.md#several-backward-passes."
            )
        self.loss, self.divisor = record, (divisor / weight if weight else 0.0)

    def skip(self, p, attr: str, error: Exception, record) -> None:
        """Leave ``p.<attr>`` out (``collect(skip_unsupported=True)``), or re-raise ``error``.
        The diagonal written instead needs ``p`` used by one call."""
        if self.skip_into is None:
            raise error
        first = self.skipped_calls.setdefault((id(p), attr), record)
        if first is not record:
            raise module_error(
                record.module,
                f"parameter {name_of(p)!r} has no Kronecker factorisation and is used by several "
                "module calls in this pass, so its diagonal fallback would miss the cross terms. "
                "Use DiagGGNExact or DiagGGNMC for it; see docs/support.md#no-kronecker-factors.",
            )
        self.skipped[(id(p), attr)] = (name_of(p), getattr(error, "cause", None) or str(error))

    def missing(self, p, attrs) -> list:
        """Those of ``attrs`` that ``p`` gets neither a value for nor a reason to skip."""
        key = id(p)
        return [a for a in attrs if (key, a) not in self.pending and (key, a) not in self.skipped]

    def write(self, accumulator, n: int, untouched) -> set:
        """Combine with the earlier passes (``n`` samples in this one) and set every pending
        attribute, except on the parameters ``untouched`` (``id(p) -> True``) by this pass.
        A parameter FSDP2 gathered for the computation is written for on its sharded
        parameter (:meth:`target`), whole (the rank's samples, the full shape). Returns the
        ``id``s of the parameters written for (or left out, ``skip``), the sharded ones
        included."""
        for key, uses in self.kron_uses.items():
            self.pending[key] = (self.pending[key][0], _combined(uses))
        if self.skip_into is not None:
            self.skip_into.update(self.skipped.values())
        written = {key for key, _ in self.skipped}
        sharded = self.sharded
        for (key, attr), (p, value) in self.pending.items():
            if untouched.get(key):
                continue
            target = sharded.get(key, p)  # (:meth:`target`, the id at hand)
            value = accumulator.combine(target, attr, typed(quantity(attr), value), n)
            setattr(target, attr, value)
            written.update((key, id(target)))
        self.pending.clear()
        accumulator.reduction_scale += self.reduction_scale
        self.reduction_scale = 0.0
        return written

    def clear(self) -> None:
        """Forget everything (the pass failed)."""
        self.kron_uses.clear()
        self.basis_uses.clear()
        self.bases.clear()
        self.pending.clear()
        self.reduction_scale = 0.0
