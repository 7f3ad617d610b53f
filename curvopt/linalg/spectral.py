"""Spectra and traces of a symmetric ``(P, P)`` ``LinearOperator`` ``C`` from products only.

* :func:`top_eigenpairs`: the ``k`` largest (or smallest) eigenpairs by Lanczos
  (``scipy.sparse.linalg.eigsh``);
* :func:`hutchinson_trace`: ``tr C ≈ (1/m) Σ_i z_iᵀ C z_i``, Rademacher ``z_i``;
* :func:`hutchinson_diagonal`: ``diag C ≈ (1/m) Σ_i z_i ⊙ C z_i``.

Estimates come with their standard error ``std(samples) / sqrt(m)`` (the sample standard
deviation over the ``m`` probes), so a caller can tell how far to trust them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.sparse.linalg import LinearOperator, eigsh


@dataclass(frozen=True)
class Estimate:
    """A Monte-Carlo estimate: ``value``, its ``std_error`` (same shape) and the probe count."""

    value: np.ndarray | float
    std_error: np.ndarray | float
    num_samples: int


def top_eigenpairs(
    op: LinearOperator, k: int = 1, which: str = "LA", tol: float = 0.0, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """``(values [k], vectors [P, k])``, values sorted from largest to smallest.

    ``which``: ``"LA"`` largest algebraic (default), ``"SA"`` smallest, ``"LM"`` largest
    magnitude. ``k < P`` is required (use ``np.linalg.eigh(op.to_dense())`` for all of them).
    """
    size = op.shape[0]
    if not 1 <= k < size:
        raise ValueError(f"top_eigenpairs: need 1 <= k < P = {size}, got k={k}")
    start = np.random.default_rng(seed).standard_normal(size).astype(op.dtype)
    values, vectors = eigsh(op, k=k, which=which, tol=tol, v0=start)
    order = np.argsort(values)[::-1]
    return values[order], vectors[:, order]


def _probes(op: LinearOperator, num_samples: int, seed: int) -> np.ndarray:
    """``Z ⊙ (C Z)`` for Rademacher probes ``Z [P, m]``."""
    if num_samples < 2:
        raise ValueError(f"need num_samples >= 2 for a standard error, got {num_samples}")
    rng = np.random.default_rng(seed)
    probes = rng.choice(np.array([-1.0, 1.0], dtype=op.dtype), size=(op.shape[0], num_samples))
    return probes * (op @ probes)


def hutchinson_trace(op: LinearOperator, num_samples: int = 32, seed: int = 0) -> Estimate:
    """Unbiased ``tr C`` from ``num_samples`` Rademacher probes (one ``matmat``)."""
    products = _probes(op, num_samples, seed)
    samples = products.sum(0)
    return Estimate(
        float(samples.mean()), float(samples.std(ddof=1) / np.sqrt(num_samples)), num_samples
    )


def hutchinson_diagonal(op: LinearOperator, num_samples: int = 32, seed: int = 0) -> Estimate:
    """Unbiased ``diag C`` (``[P]``) from ``num_samples`` Rademacher probes, element-wise errors."""
    products = _probes(op, num_samples, seed)
    return Estimate(products.mean(1), products.std(1, ddof=1) / np.sqrt(num_samples), num_samples)
