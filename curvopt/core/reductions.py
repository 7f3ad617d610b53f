"""Reductions over the leading (sample/column) dims of large tensors, without big temporaries.

``torch.linalg.vector_norm(x, dim=0)`` and ``(x * x).sum(0)`` are slow or allocate a copy of
``x`` for tensors of 100+ MB on a CPU; accumulating row by row reads ``x`` once.

Gram products ``UᵀU`` of ``M < D`` rows carry their root ``U`` (:func:`gram`, :func:`gram_root`),
and :class:`GramFactor` is such a product kept as its root alone: the curvature average of
factors narrower than their layer (``optim.transforms.ema``), with no ``D × D`` matrix formed,
stored or read. The optimizer inverts it by Woodbury from the root (``inversion.factor_inverse``:
for ``M ≤ D/2`` that form is always the cheaper one); where a dense matrix is needed after all
(eigendecompositions, the exact Kronecker damping, a rank cap, the quadratic model),
:func:`dense` forms ``UᵀU`` (``2 M D²`` flops). It is exact: the same matrix in another form.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: rows at least this large are accumulated one by one; smaller ones in one vectorised op
_ROW_LOOP = 1 << 14


def sum_of_squares(x: torch.Tensor, dims: int = 1) -> torch.Tensor:
    """``sum over the first `dims` dims of x**2``, shape ``x.shape[dims:]``."""
    rows = x if dims == 1 else x.reshape(-1, *x.shape[dims:])
    if math.prod(x.shape[dims:]) < _ROW_LOOP:
        return (rows * rows).sum(0)
    total = torch.zeros_like(rows[0])
    for row in rows:
        total.addcmul_(row, row)
    return total


def squared_norms(x: torch.Tensor) -> torch.Tensor:
    """``[N]``: ``||x_n||^2`` of every row of ``x`` (``[N, ...]``)."""
    return torch.linalg.vector_norm(x.reshape(x.shape[0], -1), dim=1).square_()


def probe_columns(
    x: torch.Tensor, spans: int = 16, width: int = 256, rows: bool = True
) -> torch.Tensor:
    """``x [R, ...]``, ``R`` rows of ``M`` entries each, restricted to ``spans`` evenly spaced
    runs of ``width`` entries of each row, as a strided view ``[R, spans, width]`` (no copy
    where ``x`` is contiguous), for cheap spot checks; ``x`` itself (as ``[R, 1, M]``) when
    ``M <= spans * width``. Without ``rows``, ``x`` is a single row and ``R`` is left out:
    ``[spans, width]`` (the same entries as ``probe_columns(x.reshape(1, -1))[0]``, with no
    view between)."""
    if not x.is_contiguous():
        x = x.contiguous()
    lead = x.shape[:1] if rows else ()
    numel = math.prod(x.shape[1:] if rows else x.shape)
    if numel <= spans * width:
        return x.reshape(*lead, 1, numel)
    step = (numel - width) // (spans - 1)
    strides = (numel, step, 1) if rows else (step, 1)
    return x.as_strided((*lead, spans, width), strides, x.storage_offset())


def nonzero_rows(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` ``[M, D]`` without its rows that are zero everywhere, where at least half are
    (the rows of a Gram product that add nothing: ``rowsᵀ rows`` is unchanged, up to rows
    whose squares underflow); ``rows`` itself otherwise. Never empty (one zero row stands for
    none, so that the product keeps a root). Found by row norms (one fast pass;
    ``ne(0).any(1)`` costs 20x more)."""
    norms = torch.linalg.vector_norm(rows, dim=1)
    kept = int(torch.count_nonzero(norms))  # the rows whose norm is != 0 (NaN included)
    if 2 * kept > rows.shape[0]:
        return rows
    return rows[norms != 0] if kept else rows[:1]


#: Gram products at least this wide (and at least as tall) are computed by symmetric blocks
_GRAM_BLOCKED = 512
_GRAM_BLOCKS = 4


def gram(rows: torch.Tensor, scale: float = 1.0, root: bool = True) -> torch.Tensor:
    """``scale · rowsᵀ rows`` (``[M, D] -> [D, D]``, symmetric positive semi-definite).

    Wide and tall products (``D ≥ 512``, ``M ≥ D``) compute only the upper block triangle of a
    4 x 4 block split and mirror it (10/16 of the flops of one matmul, a stand-in for BLAS
    ``syrk``). When ``M < D`` the product has rank at most ``M`` and carries its root (see
    :func:`gram_root`), unless ``root`` is False (one term of a sum of more than ``D`` rows).
    Rows ``[G, M, D]`` give the ``G`` products ``[G, D, D]`` (the per-group factors of a grouped
    convolution), by one batched product, without roots.
    """
    if rows.dim() == 3:
        return torch.baddbmm(rows.new_zeros(()), rows.mT, rows, beta=0, alpha=scale)
    dim = rows.shape[1]
    if dim >= _GRAM_BLOCKED and rows.shape[0] >= dim:
        product = rows.new_empty(dim, dim)
        bounds = [dim * i // _GRAM_BLOCKS for i in range(_GRAM_BLOCKS + 1)]
        for lo, hi in zip(bounds, bounds[1:]):
            block = rows[:, lo:hi].T @ rows[:, lo:]
            product[lo:hi, lo:] = block
            product[hi:, lo:hi] = block[:, hi - lo :].T
        return product.mul_(scale) if scale != 1 else product
    product = torch.addmm(rows.new_zeros(()), rows.T, rows, beta=0, alpha=scale)
    if root and rows.shape[0] < dim:
        product.gram_root = rows * scale**0.5
    return product


#: elements of the per-block products that :func:`block_gram` holds at once
_BLOCK_GRAM_BUDGET = 1 << 22


def block_gram(blocks: torch.Tensor) -> torch.Tensor:
    """``sum_m B_m B_mᵀ`` for blocks ``[M, C, L]`` (``[C, C]``): the Gram matrix of the rows of
    all blocks side by side, by batched matmuls on the blocks as laid out (the single matmul of
    :func:`gram` would need them transposed to ``[M L, C]``, a copy that costs more than the
    products), in chunks of blocks whose ``C x C`` products stay within a budget."""
    count, channels = blocks.shape[:2]
    step = max(1, _BLOCK_GRAM_BUDGET // (channels * channels))
    total = None
    for start in range(0, count, step):
        chunk = blocks[start : start + step]
        part = torch.bmm(chunk, chunk.transpose(1, 2)).sum(0)
        total = part if total is None else total.add_(part)
    return total


def gram_root(matrix: torch.Tensor) -> torch.Tensor | None:
    """``U [M, D]`` with ``matrix = Uᵀ U`` and ``M < D``, for a product of :func:`gram` (or of
    :func:`gram_add_`); ``None`` for any other matrix. Whoever modifies such a matrix in place
    must go through :func:`gram_add_`; consumers check the root against the matrix anyway."""
    return getattr(matrix, "gram_root", None)


def gram_add_(matrix: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``matrix += other`` in place, keeping the root (the rows of both stacked) while the
    stacked rows stay fewer than ``D``, dropping it otherwise."""
    roots = (gram_root(matrix), gram_root(other))
    matrix.add_(other)
    if hasattr(matrix, "gram_root"):
        del matrix.gram_root
    if roots[0] is not None and roots[1] is not None:
        stacked = torch.cat(roots)
        if stacked.shape[0] < matrix.shape[0]:
            matrix.gram_root = stacked
    return matrix


@dataclass(frozen=True)
class GramFactor:
    """``F = rootᵀ root`` of size ``d = root.shape[1]``; read like a factor for its shape,
    dtype, device and Gram root (:func:`gram_root` reads :attr:`gram_root`)."""

    root: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        dim = self.root.shape[1]
        return torch.Size((dim, dim))

    @property
    def dtype(self) -> torch.dtype:
        return self.root.dtype

    @property
    def device(self) -> torch.device:
        return self.root.device

    @property
    def gram_root(self) -> torch.Tensor:
        return self.root

    def to(self, *args, **kwargs) -> "GramFactor":
        """As ``Tensor.to`` (dtype, device), on the root; ``self`` where nothing changes."""
        root = self.root.to(*args, **kwargs)
        return self if root is self.root else GramFactor(root)


def dense(factor) -> torch.Tensor:
    """``factor`` as a dense matrix: a :class:`GramFactor`'s ``UᵀU`` (carrying ``U`` as its Gram
    root, :func:`gram`), any other factor itself."""
    return gram(factor.root) if isinstance(factor, GramFactor) else factor


def dense_gradient(grad: torch.Tensor) -> torch.Tensor:
    """A sparse gradient (``nn.Embedding(sparse=True)``) as the dense tensor it stands for."""
    return grad.coalesce().to_dense() if grad.is_sparse else grad


def diagonal(factor) -> torch.Tensor:
    """``diag F`` (``[d]``): ``Σ_r U_r²`` of a :class:`GramFactor`, the diagonal of a matrix
    (``[G, d]``: of each of the stacked factors ``[G, d, d]`` of a grouped convolution)."""
    if isinstance(factor, GramFactor):
        return factor.root.square().sum(0)
    return torch.diagonal(factor, dim1=-2, dim2=-1)


def empty_like(factor, *shape: int) -> torch.Tensor:
    """An uninitialised tensor of ``factor``'s dtype and device, of ``shape`` (default
    ``[d, d]``)."""
    size = shape or tuple(factor.shape)
    return torch.empty(size, dtype=factor.dtype, device=factor.device)


# averaged factors live in optimizer state: loadable with torch.load(weights_only=True)
torch.serialization.add_safe_globals([GramFactor])
