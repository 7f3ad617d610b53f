"""``python -m paper_figs [all|overhead|curves|table|ttr|compare] RESULTS_DIR OUT_DIR``."""

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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m paper_figs", description=__doc__)
    p.add_argument("what", choices=list(WHAT))
    p.add_argument("results_dir", type=Path, help="folder (searched recursively) or one JSON")
    p.add_argument("out_dir", type=Path)
    args = p.parse_args(argv)
    return draw_main(WHAT[args.what], args.results_dir, args.out_dir)
