"""What one backward pass computes (layer 5), given the module calls and the loss.

* ``rows``: which loss rows belong to which sample; the probe-verified packing of columns;
* ``compress``: a language model head's exact columns re-factored at its narrower input;
* ``curvature``: ``CurvaturePass``: the loss's square-root columns, packed, propagated in
  chunks within a memory budget, turned into every module's contributions;
* ``kron_pass``: ``FactorStream``: Kronecker factors from each chunk of columns;
* ``diagonals``: columns to curvature diagonals through the layer rules;
* ``hessian``: the residual terms of curved nonlinearities (``DiagHessian``);
* ``kfra``: the KFRA recursion;
* ``loss_context``: what ``hessian`` and ``kfra`` read of one loss;
* ``reducer``: ``FirstOrderReducer``: per-sample gradients and their reductions, chunked;
* ``results``: the result buffer of one pass, written only when the pass finishes;
* ``accumulate``: several passes in one ``collect``, by each quantity's combine rule.

This package imports nothing itself: each module is imported by name.
"""
