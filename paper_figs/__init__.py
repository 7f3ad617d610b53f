"""Figures and tables of the BackPACK paper (Dangel et al., ICLR 2020) from our result files.

Each function takes a results directory (searched recursively for the run JSONs of
``experiments.runner`` and the overhead JSON of ``experiments.overhead``) and an output
directory, draws with matplotlib's Agg canvas (no display needed) and returns the written paths:

* :func:`plot_overhead` -> ``overhead.png``: each quantity's time as a ratio to the gradient
* :func:`plot_curves`   -> ``curves_<problem>.png``: median/quartiles over seeds per epoch and
  against wall-clock, one line per optimizer
* :func:`write_table`   -> ``comparison.md``: our final test accuracies next to the paper's,
  budgeted and synthetic runs marked as not comparable
* :func:`plot_ttr`      -> ``ttr.png``: the time-to-result benchmark (the JSON files of
  ``python -m experiments ttr`` and ``ttr_cost``)

``paper_figs`` reads result files only; it never imports ``experiments``.

Command line: ``python -m paper_figs [all|overhead|curves|table|ttr] RESULTS_DIR OUT_DIR``
(:mod:`paper_figs.cli`), or ``python -m paper_figs.table RESULTS_DIR OUT_DIR``.
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
    "plot_ttr": "ttr",
    "make_all": "cli",
}


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = list(_EXPORTS)
