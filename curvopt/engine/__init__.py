"""What one backward pass computes (layer 5), given the module calls and the loss.

* ``producers``: the producer table: for each ``Producer``, the parts of a pass that compute it
  (the pass reads it; nothing else compares producers);
* ``rows``: which loss rows belong to which sample: the probes that verify a layout
  (``core.layouts.RowLayout``, kept in the plan);
* ``compress``: a language model head's exact columns re-factored at its narrower input
  (``HeadCut``, a strategy);
* ``curvature``: ``CurvaturePass``: the loss's square-root columns (``LossColumns``), packed,
  in chunks within a memory budget, propagated by the group's strategy (``Direct``, or
  ``compress.HeadCut``; ``choose`` picks it from the walk, the choice kept in the structure's
  plan), turned into every module's contributions;
* ``kron_pass``: ``FactorStream``: Kronecker factors from each chunk of columns;
* ``parameter_sites``: raw parameters read at the add or expand where they meet the batch, as
  calls of their own (``SiteCall``), probe-verified, instead of re-running their module; in
  first order read by the gradient arriving there (``SiteReadings``);
* ``diagonals``: columns to curvature diagonals through the layer rules;
* ``hessian``: the residual terms of curved nonlinearities (``DiagHessian``);
* ``kfra``: the KFRA recursion;
* ``loss_context``: what ``hessian`` and ``kfra`` read of one loss;
* ``reducer``: ``FirstOrderReducer``: per-sample gradients and their reductions, chunked; each
  call's ``sum_n g_n`` handed to the sum checks;
* ``probes``: the pass's random probes of the projected sums;
* ``results``: the result buffer of one pass, written only when the pass finishes;
* ``accumulate``: several passes in one ``collect``, by each quantity's combine rule.

This package imports nothing itself: each module is imported by name.
"""
