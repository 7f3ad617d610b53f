"""The damping-and-inversion layer: ``(C + λ I)⁻¹`` of a parameter's curvature ``C``, and how
``λ`` evolves. Pure tensor math on curvature values (no optimizer state, no pass), shared by the
optimizers (``curvopt.optim``, whose ``Precondition`` stage applies it) and by ``curvopt.linalg``
(whose ``inverse()`` operators apply the same inverses, to the last bit).

Its public functions and classes are re-exported by ``curvopt.optim``, the one public surface
(``from curvopt.optim import kron_solve``); the modules below are their home.

* ``damping``: damping strategies (``ConstantDamping``, ``ScheduledDamping``,
  ``LevenbergMarquardt``, ``RelativeDamping``, ``ReductionScaledDamping``, ``as_damping``,
  ``damping_strategy``, ``reduction_ratio``): the scalar ``λ`` over steps;
* ``inverses``: ``DampedInverse``, one per curvature type (``build`` once, ``apply`` to a batch):
  ``DiagonalInverse``, ``EigenCorrectedInverse`` (Kronecker's is in ``kronecker``);
* ``diagonal``: a diagonal curvature ``diag(c)``: ``g / (c + λ)`` and the quadratic form;
* ``kronecker``: a Kronecker block ``B ⊗ A``: products, quadratic forms, ``KroneckerInverse``
  and its dampings (trace-norm, trace-norm in eigenbases, exact);
* ``trace_norm``: the trace-norm split of ``λ`` over the factors (Martens & Grosse 2015,
  Sec. 6.3) and the Kronecker solves with the damped factors;
* ``factor_inverse``: one damped factor ``F + c I``: Cholesky factors, dense inverses, or
  Woodbury from a Gram root (``LowRankInverse``), in a working precision;
* ``warm_eigh``: an eigenbasis refreshed from the last one by one power step and a QR (SOAP's),
  in place of a new eigendecomposition (``basis_refresh="warm"``);
* ``newton_root``: inverse ``p``-th roots by the coupled Newton iteration, products only,
  optionally in low precision and warm-started (measured against Cholesky, not the default);
* ``eigen_corrected``: EKFAC's curvature ``Q diag(vec S) Qᵀ`` in a Kronecker eigenbasis: the
  basis, ``S``'s products, solves (and their coordinates in the basis) and quadratic forms.

Imports point down only: ``core`` and ``layers`` (the eigenbasis rotation); nothing here
imports ``optim`` or ``linalg``.
"""
