"""What curvopt reads of torch's autograd beyond its public API (layer 1).

Nothing above this folder names an autograd node class or calls a private accessor;
``tests/test_torch_internals.py`` checks all three modules against the installed torch.

* ``torch_internals``: every autograd node name curvopt branches on, and the private
  accessors it calls (saved tensors, the current graph task, the engine's backward over
  batched columns);
* ``torch_rerun``: a reentrant checkpoint's segment re-run from its node's private state;
* ``second_derivatives``: ``phi''`` of the curved elementwise ops, read off their nodes.

This package imports nothing itself: each module is imported by name.
"""
