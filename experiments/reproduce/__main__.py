"""``python -m experiments.reproduce``: the main job (see :mod:`experiments.reproduce`)."""

import sys

from .cli import main

sys.exit(main())
