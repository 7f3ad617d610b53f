"""Which damping trains every DeepOBS network at the defaults: candidate scales.

    OMP_NUM_THREADS=1 python -m benchmarks.damping_variants --variant mean --alphas 0.03 2
        [--problems ...] [--seeds 2]

``KFAC(params, lr=0.05)`` as ``benchmarks.default_robustness`` swaps it in (its
``loss_ratio``), with the relative damping ``λ = α · m`` of the group's scale ``m`` read at
the first refresh in one of these ways (``--variant``):

(``--optimizer EKFAC``: the absolute ones only)

* ``mean`` -- the former default (``relative_damping``): the mean over the group's parameters
  of ``tr(C)/dim(C)``;
* ``max`` -- their largest ``tr(C)/dim(C)``;
* ``output`` -- the loss's output-space scale times the inputs': the largest ``tr(B)/dim(B)``
  of the group (the output layer's ``B``, the loss Hessian w.r.t. the network's output, as
  sampled) times the mean ``tr(A)/dim(A)`` of its weights: a scale of the loss and the data,
  not of the Jacobians between the layers and the output;
* ``rising`` -- ``mean`` re-read at every refresh, never below its largest value so far (the
  first refresh's a floor);
* ``absolute`` -- no scale: ``λ = α`` (``damping=α``), the curvature every 10 steps as at the
  defaults (``curvature_interval=10``): for these means over samples (``s = 1``) the steps of
  the default ``λ = α s`` at ``α`` (``ReductionScaledDamping``, ``α = 1e-2``);
* ``loss`` -- the loss's own curvature at the output: ``λ = α · h``, ``h`` the mean eigenvalue
  of the cross-entropy's Hessian w.r.t. the logits, ``(1 − Σ_c p_c²)/C``, averaged over the
  task's images at the initial weights (:func:`output_scale`; the same for any network whose
  initial predictions are near uniform, ``≈ 1/C``), as an absolute damping like ``absolute``;
* ``loss_trace`` -- as ``loss`` with the trace ``1 − Σ_c p_c²`` for ``h`` (``≈ 1`` whatever the
  number of classes).

Printed per variant, ``α`` and network: ``L_end / L_start`` per seed and the seeds on target
(``default_robustness.steps_and_target``).
"""

from __future__ import annotations

import argparse
import functools
import math

import torch

from benchmarks.default_robustness import PROBLEMS, loss_ratio, steps_and_target, templated_task
from curvopt.inversion.damping import RelativeDamping
from curvopt.optim import EKFAC, KFAC


def _mean_eigenvalue(factor: torch.Tensor) -> float:
    return float(factor.diagonal().mean() if factor.dim() == 2 else factor.mean())


def group_scale(variant: str, curvatures: list) -> float:
    """The scale ``m`` of a group's Kronecker curvatures ``[B, A]`` (a bias ``[B]``)."""
    if variant in ("mean", "rising"):
        return sum(math.prod(map(_mean_eigenvalue, c)) for c in curvatures) / len(curvatures)
    if variant == "max":
        return max(math.prod(map(_mean_eigenvalue, c)) for c in curvatures)
    output = max(_mean_eigenvalue(c[0]) for c in curvatures)
    inputs = [_mean_eigenvalue(c[-1]) for c in curvatures if len(c) == 2]
    return output * sum(inputs) / len(inputs)


def output_scale(logits: torch.Tensor, trace: bool = False) -> float:
    """``h = mean_n tr(diag(p_n) − p_n p_nᵀ)/C = mean_n (1 − Σ_c p_nc²)/C``, ``p_n`` the softmax
    of the ``[N, C]`` logits: the mean eigenvalue of the cross-entropy's Hessian w.r.t. a
    sample's logits, averaged over the samples (``trace``: without the ``1/C``)."""
    probs = logits.softmax(-1)
    return float((1 - (probs**2).sum(-1)).mean() / (1 if trace else logits.shape[-1]))


def task_output_scale(problem: str, trace: bool = False) -> float:
    """:func:`output_scale` of the task's network on its images at the initial weights."""
    model, _, X, _ = templated_task(problem)
    with torch.no_grad():
        return output_scale(model(X), trace)


#: the group scales of :class:`VariantKFAC`, then the absolute dampings (any optimizer)
VARIANTS = ("mean", "max", "output", "rising", "absolute", "loss", "loss_trace")


class VariantKFAC(KFAC):
    """``KFAC`` whose relative damping reads its group scale by :func:`group_scale`."""

    def __init__(self, params, variant: str, **options):
        super().__init__(params, **options)
        self.variant = variant

    def _relative_damping(self, step, group_state):
        scale = group_state.get("curvature_scale")
        curvatures = [item.curvature for item in step.params if item.curvature is not None]
        fresh = any(item.fresh is not None for item in step.params)
        if curvatures and (scale is None or (self.variant == "rising" and fresh)):
            found = group_scale(self.variant, curvatures)
            scale = group_state["curvature_scale"] = max(found, scale or 0.0)
        group = step.group
        return RelativeDamping(group["relative_damping"]).of(scale or 0.0) + group["weight_decay"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=VARIANTS, default="mean")
    parser.add_argument("--optimizer", choices=("KFAC", "EKFAC"), default="KFAC")
    parser.add_argument("--alphas", type=float, nargs="+", default=[0.03])
    parser.add_argument("--problems", nargs="+", default=list(PROBLEMS), choices=PROBLEMS)
    parser.add_argument("--seeds", type=int, default=2)
    args = parser.parse_args(argv)
    if args.optimizer != "KFAC" and args.variant in VARIANTS[:4]:
        parser.error(f"--variant {args.variant} reads KFAC's factors: use --optimizer KFAC")
    absolute_class = {"KFAC": KFAC, "EKFAC": EKFAC}[args.optimizer]
    torch.set_num_threads(1)
    print("| optimizer | variant | α | network | ratio per seed | on target |")
    print("|---|---|---|---|---|---|")
    for alpha in args.alphas:
        for problem in args.problems:
            absolute = {"absolute": 1.0, "loss": None, "loss_trace": None}.get(args.variant, 0.0)
            if absolute is None:
                absolute = task_output_scale(problem, trace=args.variant == "loss_trace")
            make = (
                functools.partial(
                    absolute_class, lr=0.05, damping=alpha * absolute, curvature_interval=10
                )
                if absolute
                else functools.partial(
                    VariantKFAC, variant=args.variant, lr=0.05, relative_damping=alpha
                )
            )
            ratios = [loss_ratio(make, problem, seed) for seed in range(args.seeds)]
            met = sum(math.isfinite(r) and r < steps_and_target(problem)[1] for r in ratios)
            shown = " ".join(f"{r:.4g}" for r in ratios)
            cells = (
                args.optimizer,
                args.variant,
                f"{alpha:g}",
                problem,
                shown,
                f"{met}/{args.seeds}",
            )
            print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
