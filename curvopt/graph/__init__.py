"""The autograd graph upstream of a loss, and propagation through it (layer 4).

* ``search``: the one graph search (``search``) and the one read of a node's edges
  (``edges_of``) every traversal uses;
* ``walk``: ``Walk``, the one walk of the graph upstream of a loss: the module calls, their
  consumers, the checkpoints it re-ran, the leaves' ``AccumulateGrad`` nodes;
* ``propagate``: ``J^T`` of many columns at once from a root to the module outputs;
* ``checkpointing``: reentrant ``torch.utils.checkpoint`` segments re-run, columns propagated
  across them in stages;
* ``pooling``: columns across max pooling all at once, scattered at its saved indices (and
  across constant padding, cropped);
* ``broadcast``: calls without a batch dim (positions of a shared ``arange``).

This package imports nothing itself: each module is imported by name.
"""
