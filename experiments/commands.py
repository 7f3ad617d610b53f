"""What every sub-command of ``python -m experiments`` shares: the help formatter, ``--threads``
and the way an old module entry point (``python -m experiments.overhead``) runs the same command.

Each command is a :class:`Command`; :mod:`experiments.cli` lists them.
"""

from __future__ import annotations

import argparse
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

#: why 1 thread on a shared machine; the README and every --threads help say it
SHARED_MACHINE = (
    "On a machine shared with other jobs use 1: OpenMP threads then wait for each other (on a "
    "busy 2-core machine a KFAC step of MNIST logreg took 3-8 s with 2 threads, 0.05 s with 1)."
)
THREADS_HELP = "torch threads. " + SHARED_MACHINE


def _shown(value) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(_shown(v) for v in value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions kept as written; every option with a value shows its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            not action.option_strings
            or action.nargs == 0  # flags
            or default is None
            or default is argparse.SUPPRESS
            or "default" in text
        ):
            return text
        return f"{text} (default: {_shown(default).replace('%', '%%')})"


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer ``>= low``."""

    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = "integer"  # what argparse's "invalid ... value" message names
    return parse


def add_threads(p: argparse.ArgumentParser, default: int | None) -> None:
    """``--threads N`` (``default`` None: chosen from the load average, see choose_threads)."""
    auto = " Default: 2, or 1 when the load average is above half the CPUs."
    p.add_argument(
        "--threads",
        type=at_least(1),
        default=default,
        metavar="N",
        help=THREADS_HELP + (auto if default is None else ""),
    )


def choose_threads(requested: int | None) -> tuple[int, str]:
    """``torch.set_num_threads`` value and why: ``requested``, else min(2, CPUs) on an idle
    machine and 1 on a busy one."""
    if requested:
        return requested, "--threads"
    cpus = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return min(2, cpus), "load average unknown"
    if load > cpus / 2:
        return 1, f"load average {load:.1f} on {cpus} CPUs: busy machine"
    return min(2, cpus), f"load average {load:.1f} on {cpus} CPUs"


def set_threads(requested: int | None) -> str:
    """Apply :func:`choose_threads`; returns the line to print."""
    n, why = choose_threads(requested)
    torch.set_num_threads(n)
    return f"{n} torch thread(s) ({why})"


def relative(path: str | Path) -> str:
    """``path`` as a result file may record it: relative to the working directory when below
    it, else ``.../NAME``, never the machine's absolute path."""
    p = Path(path)
    if not p.is_absolute():
        return str(p)
    try:
        return str(p.relative_to(Path.cwd()))
    except ValueError:
        return f".../{p.name}"


def command_line(argv: list[str]) -> str:
    """``python -m experiments ARGV...`` with absolute paths made :func:`relative`."""
    return shlex.join(["python", "-m", "experiments", *map(portable_argument, argv)])


def portable_argument(text: str) -> str:
    """One command-line argument as a result file may record it: an absolute path, alone or
    as ``--key=PATH``, made :func:`relative`; anything else as given."""
    key, eq, value = text.partition("=") if text.startswith("-") else ("", "", text)
    return key + eq + relative(value) if os.path.isabs(value) else text


@dataclass(frozen=True)
class Command:
    """One sub-command: ``summary`` is its line in ``python -m experiments --help``,
    ``description`` (plain text) heads its own ``--help``."""

    name: str
    summary: str
    description: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    execute: Callable[[argparse.Namespace], int]
    aliases: tuple[str, ...] = field(default=())

    def parser(self) -> argparse.ArgumentParser:
        """The command's own parser (for the old entry point)."""
        p = argparse.ArgumentParser(
            prog=f"python -m experiments {self.name}",
            description=self.description,
            formatter_class=HelpFormatter,
        )
        self.add_arguments(p)
        return p

    def register(self, sub) -> None:
        """Add this command to the sub-parsers ``sub`` of ``python -m experiments``."""
        p = sub.add_parser(
            self.name,
            aliases=list(self.aliases),
            help=self.summary,
            description=self.description,
            formatter_class=HelpFormatter,
        )
        self.add_arguments(p)
        p.set_defaults(execute=self.execute)

    def main(self, argv=None) -> int:
        """The old entry point ``python -m experiments.<module>``: the same as
        ``python -m experiments NAME``."""
        return self.execute(self.parser().parse_args(argv))
