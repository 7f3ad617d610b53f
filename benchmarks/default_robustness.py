"""How robustly the curvature optimizers train the DeepOBS networks, seed by seed.

    OMP_NUM_THREADS=1 python -m benchmarks.default_robustness [--seeds 6] [--problems ...]
        [--settings defaults readme] [--optimizers KFAC] [--order fixed] [--scales]

Each DeepOBS network (``mnist_logreg``, ``fmnist_2c2d``, ``cifar10_3c3d``,
``cifar100_allcnnc``, as ``experiments.problems`` builds them) on 64 images of a learnable task
(:func:`templated_task`: one random template per class plus noise), trained by ``KFAC``,
``EKFAC`` and ``DiagGGNNewton`` as a user swaps them in (``zero_grad``, forward, loss,
``backward``, ``step``; no ``collect`` block) for 30 steps of batch 16 (All-CNN-C: 10). A seed
sets the Monte-Carlo draws of the curvature and the batch order (``--order fixed``: the order
of seed 0 for every seed, the draws alone varying). Printed per optimizer, settings and network:
the ratio ``L_end / L_start`` of the loss on the 64 images at each seed, and in how many seeds
it met the target of ``tests/test_optim_defaults.py`` (below 0.9; All-CNN-C, which SGD and Adam
move by less than 2 % in 40 steps: below 1).

Settings: ``defaults`` is ``cls(params, lr=0.05)`` (the curvature every 10 steps, the trust
region, the damping ``λ = 1e-2 s``, ``s`` the loss's reduction scale, 1 for these means over
samples); ``relative`` the Kronecker optimizers' former default, ``relative_damping=0.03``
(``λ = 0.03 m``, ``m`` the curvatures' mean eigenvalue; ``DiagGGNNewton``'s was
``relative_damping=1``); ``readme`` the absolute ``damping=1e-3`` with the curvature at every step
(``EKFAC`` with ``basis_interval=5``); ``damping_1e-2`` and ``kl_clip_1e-4`` ``DiagGGNNewton``
with a ten times larger damping, or a ten times smaller trust region; ``reduction_0.01`` and
``reduction_0.1`` ``DiagGGNNewton`` damped by ``ReductionScaledDamping(α)`` with the curvature
every 10 steps (``0.01``: its default).
``--scales`` prints the spread of the per-parameter curvature scales the relative damping
averages (:func:`curvature_scales`).
"""

from __future__ import annotations

import argparse
import functools
import math
from collections.abc import Callable, Iterable

import torch

import curvopt
from curvopt.optim import EKFAC, KFAC, DiagGGNNewton, ReductionScaledDamping
from experiments.problems import get_problem

COMMAND = "OMP_NUM_THREADS=1 python -m benchmarks.default_robustness"
PROBLEMS = ("mnist_logreg", "fmnist_2c2d", "cifar10_3c3d", "cifar100_allcnnc")
OPTIMIZERS = {"KFAC": KFAC, "EKFAC": EKFAC, "DiagGGNNewton": DiagGGNNewton}
#: settings name -> optimizer name -> keyword options
SETTINGS = {
    "defaults": {name: {"lr": 0.05} for name in OPTIMIZERS},
    "relative": {
        "KFAC": {"lr": 0.05, "relative_damping": 0.03},
        "EKFAC": {"lr": 0.05, "relative_damping": 0.03},
        "DiagGGNNewton": {"lr": 0.05, "relative_damping": 1.0},
    },
    "readme": {
        "KFAC": {"lr": 0.05, "damping": 1e-3},
        "EKFAC": {"lr": 0.05, "damping": 1e-3, "basis_interval": 5},
        "DiagGGNNewton": {"lr": 0.05, "damping": 1e-3},
    },
    "damping_1e-2": {"DiagGGNNewton": {"lr": 0.05, "damping": 1e-2}},
    "kl_clip_1e-4": {"DiagGGNNewton": {"lr": 0.05, "damping": 1e-3, "kl_clip": 1e-4}},
    **{
        f"reduction_{alpha:g}": {
            "DiagGGNNewton": {
                "lr": 0.05,
                "damping": ReductionScaledDamping(alpha),
                "curvature_interval": 10,
            }
        }
        for alpha in (1e-2, 1e-1)
    },
}
BATCH = 16
SAMPLES = 64


def steps_and_target(problem: str) -> tuple[int, float]:
    """Steps of a run and the ratio ``L_end / L_start`` it must stay below: All-CNN-C, which
    neither SGD nor Adam moves by more than 2 % in 40 steps, 10 steps and 1."""
    return (10, 1.0) if problem == "cifar100_allcnnc" else (30, 0.9)


def templated_task(problem: str):
    """``(model, lossfunc, X, y)``: the DeepOBS network as the benchmarks build it (extended),
    on :data:`SAMPLES` images of a learnable task: one random template per class, each image
    ``0.5 · noise + its class's template``."""
    spec = get_problem(problem)
    model = curvopt.extend(spec.model(0))
    lossfunc = curvopt.extend(spec.loss())
    generator = torch.Generator().manual_seed(1)
    classes = model(torch.zeros(1, *spec.input_shape)).shape[-1]
    y = torch.arange(SAMPLES) % classes
    templates = torch.randn(classes, *spec.input_shape, generator=generator)
    X = 0.5 * torch.randn(SAMPLES, *spec.input_shape, generator=generator) + templates[y]
    return model, lossfunc, X, y


def loss_ratio(
    make_optimizer: Callable, problem: str, seed: int, order_seed: int | None = None
) -> float:
    """``L_end / L_start`` on the task's images after :func:`steps_and_target`'s steps of
    batch :data:`BATCH`; ``torch.manual_seed(seed)`` for the Monte-Carlo draws, the batch order
    from ``order_seed`` (default ``seed``); inf where a step raised (the loss exploded)."""
    torch.manual_seed(seed)
    model, lossfunc, X, y = templated_task(problem)
    opt = make_optimizer(model.parameters())
    order = torch.Generator().manual_seed(seed if order_seed is None else order_seed)
    with torch.no_grad():
        first = lossfunc(model(X), y).item()
    for _ in range(steps_and_target(problem)[0]):
        index = torch.randint(0, len(X), (BATCH,), generator=order)
        opt.zero_grad()
        lossfunc(model(X[index]), y[index]).backward()
        try:
            opt.step()
        except (FloatingPointError, torch.linalg.LinAlgError):
            return math.inf
    with torch.no_grad():
        return lossfunc(model(X), y).item() / first


def curvature_scales(problem: str) -> list[float]:
    """The mean eigenvalue ``tr(C)/dim(C)`` of each parameter's ``KFAC`` curvature after one
    step at the defaults on the task's first batch of :data:`BATCH`: what the relative damping
    averages into its scale ``m`` (``optim.newton``'s ``_curvature_scale``)."""
    torch.manual_seed(0)
    model, lossfunc, X, y = templated_task(problem)
    opt = KFAC(model.parameters(), lr=0.05)
    opt.zero_grad()
    lossfunc(model(X[:BATCH]), y[:BATCH]).backward()
    opt.step()
    states = [opt.state[p] for p in model.parameters()]
    return [float(opt._curvature_scale(s["curvature"])) for s in states if "curvature" in s]


def scale_row(problem: str) -> str:
    """Mean, median, least and largest of :func:`curvature_scales`."""
    scales = sorted(curvature_scales(problem))
    median = scales[len(scales) // 2]
    mean = sum(scales) / len(scales)
    return f"| {problem} | {mean:.2g} | {median:.2g} | {scales[0]:.2g} | {scales[-1]:.2g} |"


def rows(
    settings: Iterable[str],
    optimizers: Iterable[str],
    problems: Iterable[str],
    seeds: int,
    fixed_order: bool,
):
    """One line per optimizer, settings and network: the ratios and the seeds on target."""
    for setting in settings:
        for name, options in SETTINGS[setting].items():
            if name not in optimizers:
                continue
            for problem in problems:
                make = functools.partial(OPTIMIZERS[name], **options)
                ratios = [
                    loss_ratio(make, problem, seed, 0 if fixed_order else None)
                    for seed in range(seeds)
                ]
                target = steps_and_target(problem)[1]
                met = sum(math.isfinite(r) and r < target for r in ratios)
                shown = " ".join(f"{r:.3g}" for r in ratios)
                yield f"| {name} | {setting} | {problem} | {shown} | {met}/{seeds} |"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=OPTIMIZERS)
    parser.add_argument("--problems", nargs="+", default=list(PROBLEMS), choices=PROBLEMS)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--order", choices=("seed", "fixed"), default="seed")
    parser.add_argument("--scales", action="store_true", help="print curvature_scales instead")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.scales:
        print(f"{COMMAND} --scales: KFAC's tr(C)/dim(C) per parameter, first refresh")
        print("| network | mean | median | least | largest |")
        print("|---|---|---|---|---|")
        for problem in args.problems:
            print(scale_row(problem), flush=True)
        return
    print(f"{COMMAND} --order {args.order}: L_end / L_start per seed, seeds on target")
    print("| optimizer | settings | network | ratio per seed | on target |")
    print("|---|---|---|---|---|")
    for line in rows(
        args.settings, args.optimizers, args.problems, args.seeds, args.order == "fixed"
    ):
        print(line, flush=True)


if __name__ == "__main__":
    main()
