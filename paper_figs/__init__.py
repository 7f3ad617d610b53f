"""Figures and tables of the BackPACK paper (Dangel et al., ICLR 2020) from our result files.

Each function takes a results directory (searched recursively for the run JSONs of
``experiments.runner`` and the overhead JSON of ``experiments.overhead``) and an output
directory, draws with matplotlib's Agg canvas (no display needed) and returns the written paths:

* :func:`plot_overhead` -> ``overhead.png``: each quantity's time as a ratio to the gradient
* :func:`plot_curves`   -> ``curves_<problem>.png``: median/quartiles over seeds per epoch and
  against wall-clock, one line per optimizer
* :func:`write_table`   -> ``comparison.md``: our final test accuracies next to the paper's,
  budgeted and synthetic runs marked as not comparable

Command line: ``python -m paper_figs [all|overhead|curves|table] RESULTS_DIR OUT_DIR`` or
``python -m paper_figs.<overhead|curves|table> RESULTS_DIR OUT_DIR``.
"""

import importlib

#: public name -> submodule that defines it (imported on first use, so that running a submodule
#: with ``python -m paper_figs.table`` does not import it twice)
_EXPORTS = {
    "plot_curves": "curves",
    "plot_overhead": "overhead",
    "write_table": "table",
    "comparison_rows": "table",
    "PAPER_TEST_ACC": "table",
}


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def make_all(results_dir, out_dir) -> list:
    """All figures and the table; returns the written paths."""
    from .curves import plot_curves
    from .overhead import plot_overhead
    from .table import write_table

    return [
        *plot_overhead(results_dir, out_dir),
        *plot_curves(results_dir, out_dir),
        write_table(results_dir, out_dir),
    ]


__all__ = [*_EXPORTS, "make_all"]
