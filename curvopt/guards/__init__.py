"""The checks that turn a wrong number into an exception (layer 6).

* ``observer``: ``PassGuard``, what a guard of one pass observes: its loss, module, parameter
  and finish events (``loop.backward`` calls them);
* ``pass_guards``: autocast off, reduced losses, an extended loss where curvature is asked,
  one batch size;
* ``participation``: which parameters a pass accumulates into;
* ``checks``: the sum checks of one pass: every parameter seen, ``sum_n g_n == p.grad``, every
  curvature attribute written; ``projected``: the probes of the projected sum check;
* ``tolerance``: the checks' one tolerance policy;
* ``flow``: the gradient entering a loss's graph comes through the extended losses alone;
* ``sites``: raw parameters read where they meet the batch, checked against the rule's reading;
* ``unextended``: a backward pass through modules ``extend`` did not reach.

This package imports nothing itself: each module is imported by name.
"""
