"""Time of one training step of curvopt's optimizers (forward, backward in ``opt.collect()``,
``opt.step()``), interleaved with an SGD-momentum step on its own copy of the network (the
baseline of the ratio): the optimizers and networks of ``benchmarks/optim_steps.py``, batch 128.

A timed round is one step, so ``kfac_interval10`` mixes cheap steps and (every 10th) curvature
steps over the rounds: its median is a cheap step, its mean (pytest-benchmark's ``Mean``
column) the amortised cost. ``python benchmarks/optim_steps.py`` gives amortised ratios
(blocks of 10 steps) directly.
"""

from __future__ import annotations

import pytest
from .optim_steps import NETWORKS, OPTIMIZERS, Trainer

BATCH = 128


@pytest.mark.parametrize("network", list(NETWORKS))
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_optimizer_step(benchmark, interleaved, network, optimizer):
    trainer = Trainer.build(network, optimizer, BATCH)
    sgd = Trainer.build(network, "sgd", BATCH)
    interleaved(benchmark, (network, "curvopt.optim", optimizer), trainer.step, sgd.step)
