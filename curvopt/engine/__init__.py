"""The engine behind ``extend``/``collect``: what one backward pass does, in layers
(``docs/architecture.md``). Nothing here is public API; this package imports nothing itself, so
that each module is imported only by name.

* foundation: ``state``, ``records``, ``params``, ``reductions``, ``buffers``, ``inputs``,
  ``torch_internals``, ``psd``, ``values`` (the typed values the seam hands consumers);
* propagation: ``graph_plan``, ``propagate``, ``checkpointing``, ``compress``, ``broadcast``,
  ``rows``, ``results``, ``diagonals``, ``hessian``, ``kfra``;
* one pass: ``reducer``, ``checks``, ``curvature``, ``accumulate``, ``backward``;
* collection: ``recognize`` (a loss the model returns), ``functional`` (a loss computed from
  the model's outputs), ``unextended``, ``collection``.
"""
