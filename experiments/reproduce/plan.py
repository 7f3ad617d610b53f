"""What the main job runs: problems, optimizers, budgets, hyper-parameters."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, replace

from ..config import RunConfig
from ..optimizers import DAMPED
from ..problems import get_problem


#: The optimizers the paper reports on each problem (its table of final test accuracies); its
#: keys are the paper's problems (``experiments.problems`` has others too).
PAPER_OPTIMIZERS: dict[str, tuple[str, ...]] = {
    "mnist_logreg": ("momentum", "adam", "diagggn", "diagggn_mc", "kfac", "kflr"),
    "fmnist_2c2d": ("momentum", "adam", "diagggn", "diagggn_mc", "kfac", "kflr"),
    "cifar10_3c3d": ("momentum", "adam", "diagggn", "diagggn_mc", "kfac", "kflr"),
    "cifar100_allcnnc": ("momentum", "adam", "diagggn_mc", "kfac"),
}
PAPER_SEEDS = 10

BUDGET_PROBLEMS = ("mnist_logreg", "fmnist_2c2d")
BUDGET_OPTIMIZERS = ("momentum", "adam", "diagggn_mc", "kfac")


@dataclass(frozen=True)
class Budget:
    """How much of a problem the job trains on: epochs, samples, evaluation size, seeds."""

    epochs: int
    train_size: int | None
    eval_size: int | None
    seeds: int = 1


#: Budgeted runs, sized for 5-7 minutes on 2 shared CPU cores, 3 seeds each. MNIST logreg is
#: cheap: the whole training set, 2 epochs. On 2C2D a KFAC step costs ~2.5 s on one core (it
#: inverts a 3137 x 3137 Kronecker factor every step, as in the paper) against ~0.15 s for
#: momentum, and evaluating 1000 images ~1 s, so it gets 3 epochs of 8 steps and capped
#: evaluation sets: enough to run the whole pipeline on real data, far too little to compare
#: accuracies.
BUDGETS: dict[str, Budget] = {
    "mnist_logreg": Budget(epochs=2, train_size=None, eval_size=None, seeds=3),
    "fmnist_2c2d": Budget(epochs=3, train_size=1024, eval_size=500, seeds=3),
    "cifar10_3c3d": Budget(epochs=2, train_size=1280, eval_size=1000, seeds=1),
    "cifar100_allcnnc": Budget(epochs=2, train_size=1280, eval_size=1000, seeds=1),
}

#: (lr, damping) of the budgeted runs. Not the paper's selected values (it reports only the
#: accuracies): picked once, by final validation accuracy of seed 0, from a small grid.
#: MNIST (on 10,240 samples x 3 epochs): lr in {0.01, 0.1, 1} x damping in {1e-3, 1e-2, 1e-1}.
#: 2C2D (on the budget above): momentum lr in {0.01, 0.1}, Adam lr in {1e-4, 1e-3}, DiagGGN-MC
#: (lr, damping) in {(1e-3, 1e-3), (1e-2, 1e-2), (0.1, 0.1)}, KFAC in {(1e-2, 1e-2), (0.1, 0.1)}.
#: DiagGGN / KFLR / KFRA / M-SVAG and the CIFAR problems are untuned guesses (copied from the
#: Monte-Carlo sibling or momentum). ``--lr-grid`` searches the paper's grid on the budget.
BUDGET_HPARAMS: dict[str, dict[str, tuple[float, float | None]]] = {
    "mnist_logreg": {
        "momentum": (0.1, None),
        "adam": (0.01, None),
        "diagggn": (0.01, 0.01),
        "diagggn_mc": (0.01, 0.01),
        "kfac": (0.1, 0.01),
        "kflr": (0.1, 0.01),
        "kfra": (0.1, 0.01),
        "vsgd": (0.1, None),
    },
    "fmnist_2c2d": {
        "momentum": (0.01, None),
        "adam": (1e-3, None),
        "diagggn": (1e-3, 1e-3),
        "diagggn_mc": (1e-3, 1e-3),
        "kfac": (0.1, 0.1),
        "kflr": (0.1, 0.1),
        "kfra": (0.1, 0.1),
        "vsgd": (0.01, None),
    },
    "cifar10_3c3d": {
        "momentum": (0.01, None),
        "adam": (1e-3, None),
        **{o: (0.01, 0.01) for o in ("diagggn", "diagggn_mc", "kfac", "kflr", "kfra")},
        "vsgd": (0.01, None),
    },
    "cifar100_allcnnc": {
        "momentum": (0.01, None),
        "adam": (1e-3, None),
        **{o: (0.01, 0.01) for o in ("diagggn", "diagggn_mc", "kfac", "kflr", "kfra")},
        "vsgd": (0.01, None),
    },
}


def paper_preset(optimizer: str) -> str | None:
    """``"paper"`` for the curvature optimizers: the paper's update (``kl_clip=None``), not
    the library's default trust region; None for the others."""
    return "paper" if optimizer in DAMPED else None


@dataclass
class Plan:
    problems: list[str]
    optimizers: dict[str, list[str]]
    seeds: dict[str, int]
    full: bool
    budgets: dict[str, Budget] = field(default_factory=dict)
    hparams: dict[str, dict[str, tuple[float, float | None]]] = field(default_factory=dict)
    lr_grid: bool = False

    def configs(self, problem: str, synthetic: bool) -> list[RunConfig]:
        """The budgeted runs of ``problem`` (``--full`` uses :func:`runner.grid` instead)."""
        b = self.budgets[problem]
        out = []
        for opt in self.optimizers[problem]:
            lr, damping = self.hparams[problem][opt]
            damping = damping if opt in DAMPED else None
            for seed in range(self.seeds[problem]):
                out.append(
                    RunConfig(
                        problem,
                        opt,
                        lr,
                        damping=damping,
                        seed=seed,
                        epochs=b.epochs,
                        train_size=b.train_size,
                        eval_size=b.eval_size,
                        synthetic=synthetic,
                        preset=paper_preset(opt),
                    )
                )
        return out


def make_plan(args: argparse.Namespace) -> Plan:
    problems = list(args.problems or (PAPER_OPTIMIZERS if args.full else BUDGET_PROBLEMS))
    if args.optimizers:
        optimizers = {p: list(args.optimizers) for p in problems}
    elif args.full:
        optimizers = {p: list(PAPER_OPTIMIZERS[p]) for p in problems}
    else:
        optimizers = {p: list(BUDGET_OPTIMIZERS) for p in problems}
    budgets = {}
    for p in problems:
        if args.full:
            b = Budget(get_problem(p).epochs, None, None, PAPER_SEEDS)
        else:
            b = BUDGETS[p]
        if args.epochs is not None:
            b = replace(b, epochs=args.epochs)
        if args.train_size is not None:
            b = replace(b, train_size=args.train_size or None)
        if args.eval_size is not None:
            b = replace(b, eval_size=args.eval_size or None)
        budgets[p] = b
    seeds = {p: args.seeds or (PAPER_SEEDS if args.full else budgets[p].seeds) for p in problems}
    return Plan(problems, optimizers, seeds, args.full, budgets, BUDGET_HPARAMS, args.lr_grid)


def describe(plan: Plan) -> str:
    """The plan in a few lines."""
    lines = []
    for p in plan.problems:
        b = plan.budgets[p]
        head = (
            f"{p}: {b.epochs} epochs, "
            + (f"{b.train_size:,} training samples" if b.train_size else "all training samples")
            + (f", evaluation capped at {b.eval_size:,}" if b.eval_size else "")
            + f", {plan.seeds[p]} seed(s)"
        )
        if plan.full or plan.lr_grid:
            opts = ", ".join(plan.optimizers[p])
            lines.append(f"{head}; grid lr x damping, then the best setting: {opts}")
            continue
        opts = []
        for o in plan.optimizers[p]:
            lr, damping = plan.hparams[p][o]
            opts.append(f"{o} (lr {lr:g}" + (f", damping {damping:g})" if o in DAMPED else ")"))
        lines.append(f"{head}; " + ", ".join(opts))
    return "\n".join(lines)


def full_protocol_commands(out: str = "results/reproduce_full") -> list[str]:
    """The shell commands of the paper's protocol, one grid per problem and optimizer."""
    cmds = []
    for problem, opts in PAPER_OPTIMIZERS.items():
        for opt in opts:
            preset = " --preset paper" if paper_preset(opt) else ""
            cmds.append(
                f"python -m experiments grid {problem} {opt}{preset} --seeds {PAPER_SEEDS} "
                f"--results-dir {out}/runs"
            )
    cmds.append(
        f"python -m experiments overhead --problems 3c3d --rounds 25 --json {out}/overhead.json"
    )
    cmds.append(f"python -m paper_figs curves {out}/runs {out}/figures")
    cmds.append(f"python -m paper_figs overhead {out}/overhead.json {out}/figures")
    cmds.append(f"python -m paper_figs table {out}/runs {out}")
    return cmds
