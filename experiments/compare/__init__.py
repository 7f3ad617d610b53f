"""How good is each curvature approximation? (``python -m experiments compare PROBLEM``)

* :mod:`.metrics` the exact GGN blocks, the approximations' blocks and the metrics between them
* :mod:`.run`     the protocol: short training, checkpoints, results and their tables
* :mod:`.cli`     the command: options, result file, printing
"""
