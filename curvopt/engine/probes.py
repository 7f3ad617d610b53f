"""The probes of the projected sum check, drawn by the pass.

Where a rule computes ``sum_n g_n = sum_r b_r a_rᵀ`` from per-row factors
(``LayerRule.projected_sum``), the pass hands its sum check that sum seen through ``K = 8``
pairs of Gaussian probes, ``uᵀ (sum_n g_n) v = sum_r (b_rᵀ u)(a_rᵀ v)``, instead of the sum
itself (``reducer``); the check compares it with ``uᵀ grad v`` (``guards.projected``: the
bound and the probability that a wrong sum passes). The probes are the pass's, drawn here from
generators of its own (one per device, seeded by the pass's autograd task): fresh on every
pass, one draw per parameter for all of its calls, and the user's random streams untouched.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch

#: probe pairs of the projected sum check
PROBES = 8
#: the seed of a pass's probes, offset by its autograd task (:class:`Probes`)
PROBE_SEED = 0x5EED


def draw_probes(p, gen: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
    """Gaussian ``u [p.shape[0], K]`` and ``v [p[0].numel(), K]`` for the projected check,
    drawn from the pass's own generator ``gen`` (on ``p``'s device), so that the probes leave
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


class Probes:
    """The probes of one pass (autograd ``task``): per device a generator seeded by the task,
    one draw per parameter (:meth:`of`), dropped when the pass ends (:meth:`clear`)."""

    def __init__(self, task: int = 0):
        self.task = task
        self.generators: Dict[torch.device, torch.Generator] = {}
        self.drawn: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}  # id(p): (u, v)

    @staticmethod
    def projects(p) -> bool:
        """Whether ``p``'s sum is seen through probes if its rule can (``projection_pays``)."""
        return p.dim() > 1 and projection_pays(p)

    def of(self, p) -> Tuple[torch.Tensor, torch.Tensor]:
        """The probes of ``p`` in this pass (the same for all its calls)."""
        found = self.drawn.get(id(p))
        if found is None:
            gen = self.generators.get(p.device)
            if gen is None:
                gen = torch.Generator(device=p.device).manual_seed(PROBE_SEED + self.task)
                self.generators[p.device] = gen
            found = self.drawn[id(p)] = draw_probes(p, gen)
        return found

    def clear(self) -> None:
        self.drawn.clear()
