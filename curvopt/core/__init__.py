"""The data one backward pass hands around (layer 2); it calls nothing above it.

* ``records``: ``Record`` (a module call's inputs, left on its output's autograd node by the
  forward hook), ``LossRecord``, ``RandomState`` (the generator state a random forward started
  from, for the rules that re-run it), plan tokens of modules;
* ``calls``: ``Call``, a record completed by its output gradient: what every layer rule takes
  (``origin``: how a sliced or expanded call derives from the recorded one; ``shared``: a cache
  as long-lived as the record);
* ``extended``: what ``extend`` installed, beside the user's objects rather than on them (weakly,
  by identity): per module its path, options, live calls and hook handles, per parameter its
  path and hook handle; whether ``extend`` hooked a module or parameter;
* ``params``: which extended module owns which parameter (weakly);
* ``sharded``: FSDP2's sharded parameter behind the unsharded one a pass computes with;
* ``layouts``: ``RowLayout``, which loss rows belong to which sample, and the slots that pack
  rows of distinct samples into one column (verified by ``engine.rows``, kept in a plan);
* ``plans``: the frozen ``Plan`` of each graph structure (what holds for every graph of it:
  calls, row layouts, checked sums, compression cuts, the flow check's regions), cached across
  passes;
* ``reductions``: Gram products carrying their roots, ``GramFactor``, chunked sums;
* ``values``: the typed values ``collect`` writes, the seam to the optimizers
  (``KroneckerFactors`` with its ``uses``, ``EigenCorrected``, ``read``, ``unscaled``);
* ``passgrad``: a parameter's gradient of the pass, kept so that autograd still takes the
  tensor over into ``p.grad`` rather than copying it (``held``, read back by ``gradient``);
* ``buffers``: recycled ``grad_batch`` storage; ``psd``: ``psd_eigh``;
* ``inputs``: tensor / tuple / dict model inputs and ``ModelOutput`` selection;
* ``state``: what the hooks find the active collections through (set only while a ``collect``
  block is open or a collection armed) and the switch that silences them while curvopt itself
  runs autograd.

This package imports nothing itself: each module is imported by name.
"""
