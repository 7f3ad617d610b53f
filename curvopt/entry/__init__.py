"""Where a loss the user did not extend enters a pass (layer 8).

* ``recognize``: a loss the extended model computes and returns itself (Hugging Face's
  ``labels=``), read off the graph at the forward;
* ``functional``: a loss computed from an extended model's outputs after its forward
  (``F.cross_entropy(model(x), y)``).

This package imports nothing itself: each module is imported by name.
"""
