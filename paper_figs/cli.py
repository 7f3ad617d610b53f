"""``python -m paper_figs WHAT RESULTS_DIR OUT_DIR`` (``DESCRIPTION`` is its ``--help``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .common import draw_main
from .compare import plot_compare
from .curves import plot_curves
from .overhead import plot_overhead
from .table import write_table
from .ttr import plot_ttr


def make_all(results_dir, out_dir) -> list:
    """All figures and the table; returns the written paths."""
    return [
        *plot_overhead(results_dir, out_dir),
        *plot_curves(results_dir, out_dir),
        write_table(results_dir, out_dir),
    ]


WHAT = {
    "all": make_all,
    "overhead": plot_overhead,
    "curves": plot_curves,
    "table": lambda r, o: [write_table(r, o)],
    "ttr": plot_ttr,
    "compare": plot_compare,
}


DESCRIPTION = """\
Figures and tables from the result files of python -m experiments (paper_figs reads JSON files
only). WHAT is one of:

  all       overhead, curves and table
  overhead  overhead.png: each quantity's time as a ratio to the plain gradient
  curves    curves_PROBLEM.png: test/train loss and accuracy per epoch and against training
            time, median and quartiles over seeds; one figure per budget when the results hold
            runs of several budgets of a problem (they are never pooled)
  table     comparison.md: final test accuracies next to the BackPACK paper's
  ttr       ttr.png of the time-to-result benchmark (accuracy vs steps and vs estimated seconds)
  compare   compare_PROBLEM.png of python -m experiments compare

example: python -m paper_figs all results figures
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m paper_figs",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("what", choices=list(WHAT), metavar="WHAT", help=", ".join(WHAT))
    p.add_argument(
        "results_dir", type=Path, help="folder of result JSONs (searched recursively) or one JSON"
    )
    p.add_argument("out_dir", type=Path, help="where the figures and the table go")
    args = p.parse_args(argv)
    return draw_main(WHAT[args.what], args.results_dir, args.out_dir)
