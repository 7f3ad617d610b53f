"""``python -m experiments compare PROBLEM``: how good is each curvature approximation?

The protocol is told in ``DESCRIPTION`` (what ``--help`` prints) and run by
:mod:`experiments.compare.run`; the metrics are in :mod:`experiments.compare.metrics`.
"""

from __future__ import annotations

import json
import sys

from ..commands import Command, add_threads, set_threads
from ..data import DataMissingError
from .run import LR, MAX_BLOCK, PROBLEMS, result_path, run_compare, table

DESCRIPTION = """\
How good is each curvature approximation? Trains the problem briefly with momentum SGD and, at
the listed checkpoints (epochs; 0 = at initialisation), on a fixed curvature subset of the
training data, compares every approximation with the exact GGN, per parameter block (all of a
small parameter, a random rows x columns sub-block of a large one):

  diagonals   diag_ggn_exact, diag_ggn_mc, diag_hessian (curvopt.linalg.Diagonal)
  Kronecker   kfac, kflr, kfra (curvopt.linalg.KFAC; one that is undefined for the model is
              recorded with the engine's reason)
  eigenbasis  ekfac (curvopt.linalg.EKFAC: KFAC's eigenbasis, eigenvalues from the per-sample
              gradients)
  other       empirical_fisher

Metrics: relative Frobenius error, overlap of the top-k eigenspaces, cosine of the damped
Newton directions, and the decrease the exact quadratic model predicts for each direction.

Problems: mnist_logreg, fmnist_2c2d, gpt (the zoo's GPT-style decoder on random tokens).
--max-block 0 takes whole parameters (for logistic regression: minutes per checkpoint). Writes
RESULTS_DIR/compare/PROBLEM.json (PROBLEM_synthetic.json for random data); figures:
python -m paper_figs compare RESULTS_DIR OUT_DIR.

example: python -m experiments compare fmnist_2c2d     # about 5 minutes on 2 CPU cores
"""


def _per_problem(values: dict) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in values.items())


def add_arguments(p) -> None:
    p.add_argument("problem", choices=PROBLEMS, help="the problem")
    p.add_argument(
        "--checkpoints",
        type=int,
        nargs="+",
        default=[0, 1, 2],
        help="epochs of momentum SGD after which to compare",
    )
    p.add_argument("--train-size", type=int, default=2048, help="training samples")
    p.add_argument(
        "--curvature-size", type=int, default=256, help="samples the curvature is computed on"
    )
    p.add_argument("--batch-size", type=int, help="default: the problem's")
    p.add_argument(
        "--max-block",
        type=int,
        help=f"coordinates per block, 0: whole parameters (default: {_per_problem(MAX_BLOCK)})",
    )
    p.add_argument("--damping", type=float, default=1e-3, help="damping of the Newton directions")
    p.add_argument("--top-k", type=int, default=10, help="eigenvectors in the overlap")
    p.add_argument(
        "--lr",
        type=float,
        help=f"momentum SGD's learning rate (default: {_per_problem(LR)})",
    )
    p.add_argument("--seed", type=int, default=0, help="initialisation, data and block choice")
    p.add_argument("--synthetic", action="store_true", help="random images (marked synthetic)")
    p.add_argument(
        "--data-root", default=None, help="data folder (default: $CURVOPT_DATA or ./data)"
    )
    p.add_argument("--results-dir", default="results", help="writes RESULTS_DIR/compare/")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    add_threads(p, default=None)


def execute(args) -> int:
    set_threads(args.threads)
    try:
        result = run_compare(args)
    except (DataMissingError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    path = result_path(args.results_dir, args.problem, result["synthetic"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(table(result))
    print()
    print(table(result, "cosine"))
    print(path)
    return 0


COMPARE = Command(
    "compare",
    "curvature approximations against the exact GGN along a short training run",
    DESCRIPTION,
    add_arguments,
    execute,
)
