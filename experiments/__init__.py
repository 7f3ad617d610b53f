"""Reproduction of the BackPACK paper's optimizer benchmarks on DeepOBS problems.

``python -m experiments.fetch_data`` fetches the data, ``python -m experiments run|grid ...``
trains; see :mod:`experiments.problems`, :mod:`experiments.data` and :mod:`experiments.runner`.
"""
