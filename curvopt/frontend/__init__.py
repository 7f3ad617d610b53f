"""What users call (layer 9); ``curvopt`` re-exports it.

* ``hooks``: ``extend``: the forward hooks that leave records for backward; ``unextend``: those
  hooks taken off again;
* ``collect``: the ``collect`` block and the passes it makes of a backward pass;
* ``collection``: ``Collection``: the persistent collection an optimizer owns and arms;
* ``resting``: the hooks of the models whose collections rest taken off, put back on waking;
* ``verify``: every quantity against brute force on the user's own model.

This package imports nothing itself: each module is imported by name.
"""
