"""The projected sum check (Freivalds): its bound, and how likely a wrong sum passes it.

Where a rule computes ``sum_n g_n = sum_r b_r a_rᵀ`` from per-row factors
(``LayerRule.projected_sum``), the sum is checked through ``K = 8`` pairs of Gaussian probes
``u_k, v_k`` (drawn by the pass, ``engine.probes``: the user's random stream is untouched),
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

import torch

#: the projected sums' rounding bound, ``factor * eps * sum_r |b_r| |a_r|``
PROJECTED_FACTOR = 64


def project(matrix, u, v) -> torch.Tensor:
    """``[K]``: ``u_kᵀ matrix v_k`` for ``matrix`` of any shape seen as ``[u.shape[0], -1]``."""
    return ((matrix.reshape(u.shape[0], -1).to(v.dtype) @ v) * u).sum(0)
