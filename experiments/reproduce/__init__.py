"""The main job: the BackPACK paper's experiments (Dangel et al., ICLR 2020), budgeted by default.

    python -m experiments reproduce               # budgeted: a few minutes on 2 CPU cores
    python -m experiments reproduce --dry-run     # print the plan and the full-protocol commands
    python -m experiments reproduce --full        # the paper's protocol (days; use a GPU)

Default (budgeted, real data): MNIST logistic regression (2 epochs) and Fashion-MNIST 2C2D (3
epochs on 1024 training images), momentum / Adam / DiagGGN-MC / KFAC with fixed
hyper-parameters (``BUDGET_HPARAMS``), 3 seeds; the overhead table of 3C3D (few rounds); then
the figures (``paper_figs``) and the table of final test accuracies next to the paper's, every
budgeted number marked as not comparable. Missing MNIST / Fashion-MNIST are fetched first
(``experiments.fetch_data``); a data set that cannot be had is reported and skipped.

``--full``: all four problems, the optimizers the paper ran on each, the paper's grid
(lr in {1e-4, 1e-3, 1e-2, 1e-1, 1} x damping in {1e-4, 1e-3, 1e-2, 1e-1, 1, 10}, damping only
for the curvature methods), the best setting by final validation accuracy rerun with 10 seeds,
the problems' full epochs and training sets, the full overhead table.

Everything goes below ``--out``: ``runs/`` (one JSON per run, resumable: a finished run is
skipped when the job is started again), ``overhead.json``, ``figures/*.png``,
``comparison.md`` and ``summary.json``.

Modules: :mod:`.plan` (what runs: problems, budgets, hyper-parameters), :mod:`.jobs` (data and
training runs), :mod:`.overhead_table` (the overhead measurement), :mod:`.report` (figures and
table through ``paper_figs``: the one place in ``experiments`` that draws), :mod:`.cli`.
"""

from ..commands import choose_threads
from .cli import main, parse_args
from .overhead_table import register_second_order
from .plan import (
    BUDGET_HPARAMS,
    BUDGETS,
    PAPER_OPTIMIZERS,
    PAPER_SEEDS,
    Budget,
    Plan,
    describe,
    full_protocol_commands,
    make_plan,
)

__all__ = [
    "BUDGETS",
    "BUDGET_HPARAMS",
    "PAPER_OPTIMIZERS",
    "PAPER_SEEDS",
    "Budget",
    "Plan",
    "choose_threads",
    "describe",
    "full_protocol_commands",
    "main",
    "make_plan",
    "parse_args",
    "register_second_order",
]
