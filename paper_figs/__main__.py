"""``python -m paper_figs ...``: see :mod:`paper_figs.cli`."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
