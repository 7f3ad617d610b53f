"""Speed benchmarks: the pytest-benchmark suites (``python -m pytest benchmarks --benchmark-only``,
see ``conftest.py``) and scripts (``python -m benchmarks.optim_steps`` or
``PYTHONPATH=. python benchmarks/optim_steps.py``, ``gpu_check``, ``distributed_step``,
``hf_gpt2_overhead``).

A package, so that its modules import each other by name and the import test sees them: it sits
on top, importing ``curvopt``, ``experiments`` and ``fixtures``; nothing imports it.
"""
