"""``python -m experiments COMMAND ...``: the one entry point of every experiment."""

from __future__ import annotations

import argparse
from textwrap import fill

from .commands import SHARED_MACHINE, HelpFormatter
from .compare.cli import COMPARE
from .fetch_data import FETCH_DATA
from .models_cost import MODELS_COST
from .overhead.cli import OVERHEAD
from .reproduce.cli import REPRODUCE
from .step_profile import STEP_PROFILE
from .train_cli import GRID, RUN
from .ttr.cli import TTR, TTR_COST

#: in the order ``--help`` lists them: the main job first
COMMANDS = (
    REPRODUCE,
    FETCH_DATA,
    RUN,
    GRID,
    TTR,
    TTR_COST,
    OVERHEAD,
    STEP_PROFILE,
    COMPARE,
    MODELS_COST,
)

DESCRIPTION = f"""\
The experiments of curvopt. Start with the main job, python -m experiments reproduce (what
make run runs, about 7 minutes on 2 CPU cores); python -m experiments COMMAND --help tells
what each command does, its options and their defaults.

{fill("Threads: every command that computes takes --threads N. " + SHARED_MACHINE, 92)}
Missing data: python -m experiments fetch_data. Figures from the result files:
python -m paper_figs --help.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m experiments", description=DESCRIPTION, formatter_class=HelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.register(sub)
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    return args.execute(args)
