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
    """A Monte-Carlo estimate with its standard error, as the Hutchinson estimators return it.

    Args:
        value: the estimate (a float, or an array for a diagonal).
        std_error: ``std(samples) / sqrt(m)`` (sample standard deviation over the ``m``
            probes), of ``value``'s shape.
        num_samples: ``m``, the number of probes.

    Example:
        >>> import numpy as np
        >>> from scipy.sparse.linalg import aslinearoperator
        >>> from curvopt import linalg
        >>> op = aslinearoperator(np.diag([1.0, 2.0, 3.0]))  # or linalg.GGN(...), ...
        >>> linalg.hutchinson_trace(op, num_samples=4)  # exact for a diagonal operator
        Estimate(value=6.0, std_error=0.0, num_samples=4)
    """

    value: np.ndarray | float
    std_error: np.ndarray | float
    num_samples: int


def top_eigenpairs(
    op: LinearOperator, k: int = 1, which: str = "LA", tol: float = 0.0, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` extreme eigenpairs of a symmetric operator, by Lanczos (``scipy``'s ``eigsh``).

    Args:
        op: a symmetric ``(P, P)`` ``LinearOperator`` (any ``curvopt.linalg`` operator).
        k: the number of eigenpairs, ``1 <= k < P`` (for all of them use
            ``np.linalg.eigh(op.to_dense())``).
        which: ``"LA"`` largest algebraic (default), ``"SA"`` smallest, ``"LM"`` largest
            magnitude.
        tol: the relative accuracy of ``eigsh`` (default 0: machine precision).
        seed: the seed of the start vector (default 0).

    Returns:
        ``(values [k], vectors [P, k])``, values sorted from largest to smallest.

    Raises:
        ValueError: ``k`` is not in ``[1, P)``.

    Example:
        >>> import numpy as np
        >>> from scipy.sparse.linalg import aslinearoperator
        >>> from curvopt import linalg
        >>> op = aslinearoperator(np.diag([1.0, 2.0, 3.0]))  # or linalg.GGN(...), ...
        >>> values, vectors = linalg.top_eigenpairs(op, k=2)
        >>> values.round(6), vectors.shape
        (array([3., 2.]), (3, 2))
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
    """Hutchinson's unbiased trace estimate ``tr C ≈ (1/m) Σ_i z_iᵀ C z_i``, Rademacher ``z_i``.

    One ``matmat`` with all ``m`` probes.

    Args:
        op: a symmetric ``(P, P)`` ``LinearOperator``.
        num_samples: ``m ≥ 2`` probes (default 32).
        seed: the seed of the probes (default 0).

    Returns:
        An :class:`Estimate` with a float ``value`` and ``std_error``.

    Raises:
        ValueError: ``num_samples < 2`` (no standard error).

    Example:
        >>> import numpy as np
        >>> from scipy.sparse.linalg import aslinearoperator
        >>> from curvopt import linalg
        >>> op = aslinearoperator(np.diag([1.0, 2.0, 3.0]))  # or linalg.GGN(...), ...
        >>> linalg.hutchinson_trace(op, num_samples=8).value
        6.0
    """
    products = _probes(op, num_samples, seed)
    samples = products.sum(0)
    return Estimate(
        float(samples.mean()), float(samples.std(ddof=1) / np.sqrt(num_samples)), num_samples
    )


def hutchinson_diagonal(op: LinearOperator, num_samples: int = 32, seed: int = 0) -> Estimate:
    """Hutchinson's unbiased diagonal estimate ``diag C ≈ (1/m) Σ_i z_i ⊙ C z_i``.

    Rademacher probes ``z_i``, one ``matmat``; standard errors element-wise.

    Args:
        op: a symmetric ``(P, P)`` ``LinearOperator``.
        num_samples: ``m ≥ 2`` probes (default 32).
        seed: the seed of the probes (default 0).

    Returns:
        An :class:`Estimate` with ``value`` and ``std_error`` of shape ``[P]``.

    Raises:
        ValueError: ``num_samples < 2``.

    Example:
        >>> import numpy as np
        >>> from scipy.sparse.linalg import aslinearoperator
        >>> from curvopt import linalg
        >>> op = aslinearoperator(np.diag([1.0, 2.0, 3.0]))  # or linalg.GGN(...), ...
        >>> linalg.hutchinson_diagonal(op, num_samples=8).value
        array([1., 2., 3.])
    """
    products = _probes(op, num_samples, seed)
    return Estimate(products.mean(1), products.std(1, ddof=1) / np.sqrt(num_samples), num_samples)
