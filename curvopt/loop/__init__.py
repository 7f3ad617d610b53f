"""One backward pass, from the loss's hook to the written results (layer 7).

* ``routing``: the gradient hooks ``extend`` registers; each routes to the pass of every
  active collection;
* ``backward``: ``BackwardPass``: the router of one pass's events (loss, module, parameter,
  finish) to the engine and the guards.

This package imports nothing itself: each module is imported by name.
"""
