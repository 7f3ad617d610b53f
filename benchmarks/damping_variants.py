"""Which relative damping trains every DeepOBS network at the defaults: candidate group scales.

    OMP_NUM_THREADS=1 python -m benchmarks.damping_variants --variant mean --alphas 0.03 2
        [--problems ...] [--seeds 2]

``KFAC(params, lr=0.05)`` as ``benchmarks.default_robustness`` swaps it in (its
``loss_ratio``), with the relative damping ``λ = α · m`` of the group's scale ``m`` read at
the first refresh in one of these ways (``--variant``):

* ``mean`` -- today's default: the mean over the group's parameters of ``tr(C)/dim(C)``;
* ``max`` -- their largest ``tr(C)/dim(C)``;
* ``output`` -- the loss's output-space scale times the inputs': the largest ``tr(B)/dim(B)``
  of the group (the output layer's ``B``, the loss Hessian w.r.t. the network's output, as
  sampled) times the mean ``tr(A)/dim(A)`` of its weights: a scale of the loss and the data,
  not of the Jacobians between the layers and the output;
* ``absolute`` -- no scale: ``λ = α`` (``damping=α``), the curvature every 10 steps as at the
  defaults (``curvature_interval=10``).

Printed per variant, ``α`` and network: ``L_end / L_start`` per seed and the seeds on target
(``default_robustness.steps_and_target``).
"""

from __future__ import annotations

import argparse
import functools
import math

import torch

from benchmarks.default_robustness import PROBLEMS, loss_ratio, steps_and_target
from curvopt.inversion.damping import RelativeDamping
from curvopt.optim import KFAC


def _mean_eigenvalue(factor: torch.Tensor) -> float:
    return float(factor.diagonal().mean() if factor.dim() == 2 else factor.mean())


def group_scale(variant: str, curvatures: list) -> float:
    """The scale ``m`` of a group's Kronecker curvatures ``[B, A]`` (a bias ``[B]``)."""
    if variant == "mean":
        return sum(math.prod(map(_mean_eigenvalue, c)) for c in curvatures) / len(curvatures)
    if variant == "max":
        return max(math.prod(map(_mean_eigenvalue, c)) for c in curvatures)
    output = max(_mean_eigenvalue(c[0]) for c in curvatures)
    inputs = [_mean_eigenvalue(c[-1]) for c in curvatures if len(c) == 2]
    return output * sum(inputs) / len(inputs)


class VariantKFAC(KFAC):
    """``KFAC`` whose relative damping reads its group scale by :func:`group_scale`."""

    def __init__(self, params, variant: str, **options):
        super().__init__(params, **options)
        self.variant = variant

    def _relative_damping(self, step, group_state):
        scale = group_state.get("curvature_scale")
        curvatures = [item.curvature for item in step.params if item.curvature is not None]
        if scale is None and curvatures:
            scale = group_state["curvature_scale"] = group_scale(self.variant, curvatures)
        group = step.group
        return RelativeDamping(group["relative_damping"]).of(scale or 0.0) + group["weight_decay"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=("mean", "max", "output", "absolute"), default="mean")
    parser.add_argument("--alphas", type=float, nargs="+", default=[0.03])
    parser.add_argument("--problems", nargs="+", default=list(PROBLEMS), choices=PROBLEMS)
    parser.add_argument("--seeds", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print("| variant | α | network | ratio per seed | on target |")
    print("|---|---|---|---|---|")
    for alpha in args.alphas:
        for problem in args.problems:
            make = (
                functools.partial(KFAC, lr=0.05, damping=alpha, curvature_interval=10)
                if args.variant == "absolute"
                else functools.partial(
                    VariantKFAC, variant=args.variant, lr=0.05, relative_damping=alpha
                )
            )
            ratios = [loss_ratio(make, problem, seed) for seed in range(args.seeds)]
            met = sum(math.isfinite(r) and r < steps_and_target(problem)[1] for r in ratios)
            shown = " ".join(f"{r:.3g}" for r in ratios)
            print(f"| {args.variant} | {alpha:g} | {problem} | {shown} | {met}/{args.seeds} |",
                  flush=True)


if __name__ == "__main__":
    main()
