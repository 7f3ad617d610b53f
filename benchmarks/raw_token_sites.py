"""First-order quantities on a ViT whose class token and position embeddings are raw parameters
of the model: read at their add / expand (``engine.parameter_sites``) against the generic rule's
re-run of the whole model sample by sample, as ratios to the plain forward + backward, interleaved.

    OMP_NUM_THREADS=1 python -m benchmarks.raw_token_sites [--rounds 9] [--repeats 5]

The FMNIST ViT of the time-to-result benchmark (``experiments.problems.fmnist_vit``: 7x7
patches, 2 blocks, width 64), batch 128, random images, float32, one thread. Each round times
``repeats`` passes of the plain model, then of each quantity with the sites and without them
(``GenericRule.reruns_module`` off, the code path before the sites), in CPU time; the
medians over rounds are printed as ms and as ratios to the plain pass.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import curvopt
from curvopt import extensions as ext
from curvopt.layers.generic import GenericRule
from experiments.problems import fmnist_vit

QUANTITIES = ("BatchGrad", "BatchL2Grad", "SumGradSquared", "Variance")


def interleaved_medians(cases: dict, rounds: int, repeats: int) -> dict:
    """``{key: median ms}`` of each of ``cases`` (callables), after one warm-up call each (plans
    made, caches filled), timed in ``rounds`` interleaved rounds of ``repeats`` calls (CPU time)."""
    times = {k: [] for k in cases}
    for f in cases.values():
        f()
    for _ in range(rounds):
        for key, f in cases.items():
            t0 = time.process_time()
            for _ in range(repeats):
                f()
            times[key].append(1e3 * (time.process_time() - t0) / repeats)
    return {key: statistics.median(values) for key, values in times.items()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batch", type=int, default=128)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    bare = fmnist_vit()
    model = curvopt.extend(copy.deepcopy(bare))
    lossfunc = curvopt.extend(torch.nn.CrossEntropyLoss())
    x, y = torch.randn(args.batch, 1, 28, 28), torch.randint(0, 10, (args.batch,))

    def plain():
        bare.zero_grad()
        torch.nn.functional.cross_entropy(bare(x), y).backward()

    def quantity(name, sites):
        def run():
            GenericRule.reruns_module = sites
            model.zero_grad()
            with curvopt.collect(getattr(ext, name)()):
                lossfunc(model(x), y).backward()
            GenericRule.reruns_module = True

        return run

    cases = {"plain": plain}
    for name in QUANTITIES:
        cases[f"{name} (sites)"] = quantity(name, True)
        cases[f"{name} (re-run)"] = quantity(name, False)
    medians = interleaved_medians(cases, args.rounds, args.repeats)
    for key, ms in medians.items():
        print(f"{key:28s} {ms:7.1f} ms  {ms / medians['plain']:5.2f}x plain")


if __name__ == "__main__":
    main()
