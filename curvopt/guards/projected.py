"""The probes of the projected sum check (Freivalds).

Where a rule computes ``sum_n g_n = sum_r b_r a_rᵀ`` from per-row factors
(``LayerRule.projected_sum``), the sum is checked through ``K = 8`` pairs of Gaussian probes
``u_k, v_k`` (a generator of the checks' own: the user's random stream is untouched),
``uᵀ (sum_n g_n) v = sum_r (b_rᵀ u)(a_rᵀ v)`` against ``uᵀ grad v``, at ``O(R (I + O) K)`` plus
one read of ``grad`` instead of the ``O(R I O)`` product. Bound: ``64 eps M`` with
``M = sum_r |b_r| |a_r|`` (Euclidean norms). For random probes the rounding of either side,
``uᵀ D v`` for an error matrix ``D``, has standard deviation ``|D|_F``, and ``|D|_F`` is a few
``eps`` times ``|sum_r |b_r| |a_r|ᵀ|_F <= M`` (measured on 2C2D, 3C3D and a 512 x 256 layer
with 1024 rows in float32: at most ``3 eps M``); ``M`` sums norms, so a gradient that cancels
to nearly zero keeps its bound. A wrong sum, ``E = sum_n g_n - grad != 0``, is missed only if
``|u_kᵀ E v_k| <= 64 eps M`` for every ``k``: ``u_kᵀ E v_k = 0`` has probability 0, and with
``r = sigma_max(E) / (64 eps M)`` one probe misses with probability at most
``(2/pi)(2 + ln r) / r`` (given ``v``, ``uᵀ(E v)`` is normal with standard deviation
``|E v| >= sigma_max(E) |z|``, ``z`` standard normal), all eight at most its eighth power:
``2e-3`` for ``r = 5``, ``3e-5`` for ``r = 10``, ``1e-11`` for ``r = 100``. In float32
(``64 eps = 8e-6``) an error of ``sigma_max(E) >= 8e-5 M`` is caught but for ``3e-5``.
"""

from __future__ import annotations

from typing import Tuple

import torch

#: probe pairs of the projected sum check
PROBES = 8
#: the projected sums' rounding bound, ``factor * eps * sum_r |b_r| |a_r|``
PROJECTED_FACTOR = 64
#: the seed of a pass's probes, offset by its autograd task (``checks.Checks.probes``)
PROBE_SEED = 0x5EED


def draw_probes(p, gen: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
    """Gaussian ``u [p.shape[0], K]`` and ``v [p[0].numel(), K]`` for the projected check,
    drawn from the checks' own generator ``gen`` (on ``p``'s device), so that the probes leave
    the user's random streams untouched."""
    dtype = p.dtype if p.is_floating_point() else torch.get_default_dtype()
    u, v = (
        torch.randn(size, PROBES, generator=gen, device=p.device, dtype=dtype)
        for size in (p.shape[0], p[0].numel())
    )
    return u, v


def projection_pays(p) -> bool:
    """Whether the projected check of ``p`` (as a ``rows x cols`` matrix) costs under a sixth
    of the full sum in flops: per row of the factors, ``K (rows + cols)`` against ``rows cols``
    (the projected convolutions run at a lower rate than the weight gradient's; the sixth
    picks the faster check for every weight of 2C2D and 3C3D, ``benchmarks/projected_guard``)."""
    rows, cols = p.shape[0], p[0].numel()
    return 6 * PROBES * (rows + cols) < rows * cols


def project(matrix, u, v) -> torch.Tensor:
    """``[K]``: ``u_kᵀ matrix v_k`` for ``matrix`` of any shape seen as ``[u.shape[0], -1]``."""
    return ((matrix.reshape(u.shape[0], -1).to(v.dtype) @ v) * u).sum(0)
