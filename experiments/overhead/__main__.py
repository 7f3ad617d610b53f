"""``python -m experiments.overhead``: the same as ``python -m experiments overhead``."""

import os
import sys

# Spinning OpenMP workers turn every parallel region into a wait for a preempted thread on a
# busy machine (2-thread steps 5-100x slower, erratically); sleeping workers keep the timings
# stable. Must be set before torch loads OpenMP; export it to override.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from .cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
