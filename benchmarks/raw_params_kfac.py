"""``KFAC``'s step on ViTs that own their class and position tokens, against ``AdamW``'s: the
raw tokens read at their expand / add (``engine.parameter_sites``) or by the generic rule's
re-run of the whole model sample by sample (the code path before the sites), interleaved.

    OMP_NUM_THREADS=1 python -m benchmarks.raw_params_kfac [--rounds 7] [--repeats 3]

Two models, float32, one thread, random batches: the FMNIST ViT of the time-to-result benchmark
(``experiments.problems.fmnist_vit``, batch 128) and a timm-style ViT in training mode with drop
path 0.2 and dropout 0.1 (``fixtures.timm_like``: 32x32 images in 4x4 patches, width 64, 4
blocks, batch 32; its re-run replays the forward's draws, ``layers.random_replay``). Each round
times ``repeats`` steps of each case, in CPU time; medians over rounds, as ms and as ratios to
``AdamW``'s step (forward, backward, step). ``every 10``: the curvature and its inverses
renewed every 10 steps (``curvature_interval``, ``inverse_interval``), the cost per step
averaged over ``repeats``.
"""

from __future__ import annotations

import argparse
import warnings

import torch

import curvopt
from curvopt.layers.generic import GenericRule
from curvopt.optim import KFAC
from benchmarks.raw_token_sites import interleaved_medians
from experiments.problems import fmnist_vit
from fixtures.timm_like import VisionTransformer


def _models(args):
    """``name -> (make model, images, labels)``."""
    timm_like = dict(size=32, patch=4, channels=3, dim=64, depth=4, heads=4, classes=10)
    return {
        "fmnist_vit": (
            fmnist_vit,
            torch.randn(args.batch, 1, 28, 28),
            torch.randint(0, 10, (args.batch,)),
        ),
        "timm_like drop path": (
            lambda: VisionTransformer(**timm_like, drop_path_rate=0.2, drop_rate=0.1),
            torch.randn(args.timm_batch, 3, 32, 32),
            torch.randint(0, 10, (args.timm_batch,)),
        ),
    }


def _step(make, x, y, optimizer: str, sites: bool = True, **options):
    torch.manual_seed(0)
    model, lossfunc = make().train(), torch.nn.CrossEntropyLoss()
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step():
            opt.zero_grad()
            lossfunc(model(x), y).backward()
            opt.step()

        return step
    model, lossfunc = curvopt.extend(model), curvopt.extend(lossfunc)
    opt = KFAC(model.parameters(), lr=1e-3, damping=1e-3, **options)

    def step():
        GenericRule.reruns_module = sites
        try:
            opt.zero_grad()
            with opt.collect():
                lossfunc(model(x), y).backward()
            opt.step()
        finally:
            GenericRule.reruns_module = True

    return step


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--timm-batch", type=int, default=32)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*no Kronecker factorisation")
    warnings.filterwarnings("ignore", message="There is a performance drop")  # vmap's fallback
    for name, (make, x, y) in _models(args).items():
        cases = {
            "AdamW": _step(make, x, y, "adamw"),
            "KFAC (sites)": _step(make, x, y, "kfac"),
            "KFAC (re-run)": _step(make, x, y, "kfac", sites=False),
            "KFAC (sites, every 10)": _step(
                make, x, y, "kfac", curvature_interval=10, inverse_interval=10
            ),
        }
        medians = interleaved_medians(cases, args.rounds, args.repeats)
        for key, ms in medians.items():
            ratio = ms / medians["AdamW"]
            print(f"{name:20s} {key:22s} {ms:7.1f} ms  {ratio:5.2f}x AdamW", flush=True)


if __name__ == "__main__":
    main()
