"""Kronecker factors of a parameter's GGN block from columns ``V`` propagated to the layer output.

``kron(*factors)`` is indexed like ``p.flatten()``. Each layer rule gives its own factors, the
output side from each chunk of columns (:meth:`LayerRule.kron_output_factor`, summed over the
chunks) and the input side once per pass (:meth:`LayerRule.kron_input_factor`: it does not
depend on the columns), with the functions below, which work on one canonical weight-sharing
format: inputs ``x [N, P, I]`` and columns ``V [K, N, P, O]``, ``P`` the positions that share
the weight (sequence positions, conv locations), and give ``[B (O x O), A (I x I)]``:

* "expand": ``B = sum_{k,n,p} v v^T``, ``A = mean_{n,p} x x^T``;
* "reduce": ``B = sum_{k,n} (sum_p v)(sum_p v)^T``, ``A = mean_n xbar xbar^T``,
  ``xbar = mean_p x`` (Eschenhagen et al., 2023).

The rules: ``Linear`` and Hugging Face's ``Conv1D`` (``layers.linear``,
``layers.transposed_linear``), ``Conv{1,2,3}d`` with unfolded patches as inputs (KFC, Grosse &
Martens 2016; ``layers.conv``), ``Embedding`` (``layers.embedding``). A parameter whose rule
gives none and that is one-dimensional (biases, norm scales) gets ``[B]``, the exact block
``sum_{k,n} g_nk g_nk^T`` from the per-(sample, column) gradients (its diagonal blocks
``[G, d, d]`` for a rule with ``G`` groups, :func:`grouped_gram`); any other is unsupported.
A grouped convolution's factors are stacked per group, ``[G, d, d]`` (``layers.conv``).

For ``N = 1`` and one position each factorisation is exact. Every factor built from fewer
rows than its size carries its root (``reductions.gram_root``), for low-rank inversion.
"""

from __future__ import annotations

import torch

from curvopt.errors import kronecker_error
from curvopt.layers.registry import rule_for, subclass_note
from curvopt.core.reductions import block_gram, gram, nonzero_rows

#: elements of the inputs ``x [n, P, I]`` that :func:`input_factor_by_samples` holds at once
#: (16 MB in float32: the unfolded patches of a convolution are ``prod(kernel)`` times its input)
_INPUT_BUDGET = 1 << 22


def input_factor(x, approx):
    """``A`` from inputs ``x [N, P, I]``: mean over samples and positions of ``x xᵀ``
    ("expand"), or over samples of ``xbar xbarᵀ`` with ``xbar`` the mean over positions;
    ``[G, I, I]`` from the inputs ``x [G, N, P, I]`` of ``G`` groups, one factor per group."""
    if approx == "reduce":
        return gram(x.mean(-2), 1 / x.shape[-3])
    return gram(x.flatten(-3, -2), 1 / x.shape[-3:-1].numel())


def input_factor_by_samples(inputs_of, n: int, positions: int, features: int, approx: str):
    """:func:`input_factor` of the inputs ``x [n, P, I]`` of ``n`` samples, made by
    ``inputs_of(start, stop)`` (``[stop - start, P, I]``; ``[G, stop - start, P, I]`` for ``G``
    groups) for chunks of samples that hold at most ``_INPUT_BUDGET`` elements (``positions``
    ``P``, an estimate, times ``features`` ``I`` each, all groups'):
    ``A = sum_chunks scale · x_cᵀ x_c`` with the whole batch's scale, the same
    matrix up to the order of the sums, without the whole batch's inputs at once (a
    convolution's unfolded patches). Not chunked where the batch has fewer rows than ``I``:
    that factor carries its root (``reductions.gram_root``), the chunks' would not add up."""
    rows = n if approx == "reduce" else n * positions
    step = max(1, _INPUT_BUDGET // max(1, positions * features))
    if step >= n or rows < features:
        return input_factor(inputs_of(0, n), approx)
    total = None
    for start in range(0, n, step):  # (no name holds a chunk while the next one is made)
        part = _scaled_gram(inputs_of(start, min(n, start + step)), n, approx)
        total = part if total is None else total.add_(part)
    return total


def _scaled_gram(x, n: int, approx: str):
    """One chunk's term of :func:`input_factor_by_samples` (``n``: the whole batch's)."""
    if approx == "reduce":
        return gram(x.mean(-2), 1 / n, root=False)
    return gram(x.flatten(-3, -2), 1 / (n * x.shape[-2]), root=False)


def output_factor(v, approx):
    """``B`` from columns ``v [K, N, P, O]``. Rows zero everywhere are dropped first: columns
    packed by slot (``engine.rows``) are zero at the positions of the other slots until a
    layer mixes positions (the position-wise layers between a language model's head and its
    attention), so there the product runs over ``1/P`` of the rows."""
    return gram(nonzero_rows(v.sum(2).flatten(0, 1) if approx == "reduce" else v.flatten(0, 2)))


def output_factor_channels_first(v, approx, groups: int = 1):
    """:func:`output_factor` from the columns laid out ``[K N, O, P]`` (as a convolution's
    output is), by batched products on that layout: no transposed copy. With ``groups``
    ``G > 1``: the factors ``[G, O/G, O/G]`` of each group's ``O/G`` channels."""
    if groups == 1:
        return gram(v.sum(2)) if approx == "reduce" else block_gram(v)
    v = v.reshape(v.shape[0], groups, -1, v.shape[-1])  # [K N, G, O/G, P]
    if approx == "reduce":
        summed = v.sum(-1)
        return torch.einsum("mgc,mgd->gcd", summed, summed)
    return torch.einsum("mgcp,mgdp->gcd", v, v)


def grouped_gram(rows, groups: int):
    """``rowsᵀ rows`` for ``rows [M, D]`` (``[D, D]``), or, for ``groups`` ``G > 1``, its ``G``
    diagonal blocks ``[G, D/G, D/G]`` (the block-diagonal curvature of a grouped layer)."""
    if groups == 1:
        return gram(rows)
    return gram(rows.reshape(rows.shape[0], groups, -1).transpose(0, 1))


def kron_factors(call, columns, name: str, p: torch.Tensor, approx: str, n: int):
    """Kronecker factors of ``p`` (see module docstring) for one call from one chunk of
    columns: the output side, with ``None`` where the input-side factor goes (it does not
    depend on the columns: the caller makes it once, :meth:`LayerRule.kron_input_factor`), or
    ``[B]`` for a one-dimensional parameter."""
    module = call.module
    rule = rule_for(module)
    own = rule.kron_output_factor(call, columns, name, approx, n)
    if own is not None:
        return [own, None] if rule.output_factor_index(name) == 0 else [None, own]
    if rule.vector_parameter(name, p):
        grads = rule.expanded_batch_grad(call, columns, name)
        return [grouped_gram(grads.flatten(1), rule.kron_groups(module, name))]
    if isinstance(columns, tuple):
        cause = "curvopt factors no parameter of a module with several outputs"
    else:
        cause = "curvopt factors only Linear, Conv, Embedding and Conv1D weights and 1-D parameters"
    note = subclass_note(type(module))
    if note is not None:
        cause = f"{note}, which gives no Kronecker factors of a weight"
    raise kronecker_error(module, f"parameter {name!r}", cause)


def output_factor_index(module, name: str) -> int:
    """Position of the output-side factor ``B`` (the one built from the columns) in the list."""
    return rule_for(module).output_factor_index(name)
