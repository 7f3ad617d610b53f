"""The checks that turn a wrong number into an exception (layer 6).

* ``observer``: ``PassGuard``, what a guard of one pass observes: its loss, module, total,
  parameter and finish events (``loop.backward`` and the reducer call them); a guard raises
  and writes no result (``tests/test_guards_only_observe.py``);
* ``pass_guards``: autocast off, reduced losses, an extended loss where curvature is asked,
  one batch size;
* ``participation``: which parameters a pass accumulates into;
* ``checks``: the sum checks of one pass: every parameter seen, ``sum_n g_n == p.grad``, every
  curvature attribute written; ``projected``: the projected sum check's bound (its probes are
  the pass's, ``engine.probes``);
* ``tolerance``: the checks' one tolerance policy;
* ``flow``: the gradient entering a loss's graph comes through the extended losses alone;
* ``sites``: every raw parameter claimed for its site read (``engine.parameter_sites``), and
  the tolerance of a site's first comparison with its rule;
* ``unextended``: a backward pass through modules ``extend`` did not reach.

This package imports nothing itself: each module is imported by name.
"""
