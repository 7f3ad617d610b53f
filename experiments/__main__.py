"""``python -m experiments COMMAND ...`` (see :mod:`experiments.cli`)."""

import os
import sys

if sys.argv[1:2] == ["overhead"]:
    # as ``python -m experiments.overhead`` does: sleeping OpenMP workers keep timings stable
    # on a busy machine; must be set before torch loads OpenMP (export it to override)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from experiments.cli import main, parse_args  # noqa: E402

__all__ = ["main", "parse_args"]

if __name__ == "__main__":
    sys.exit(main())
