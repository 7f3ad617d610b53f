"""Overhead of curvopt's quantities, as ratios to a plain forward+backward pass
(``python -m experiments overhead``; ``python -m experiments.overhead`` is the same command).

Every *case* is a (problem, quantity) pair, run by every *backend* that can compute it; each job
has its own module (imports point down this list):

* :mod:`.problems`  the networks with random batches (3C3D, MLP, small CNN, transformer block,
                    DeepOBS logreg and 2C2D, a GPT-style decoder, ...)
* :mod:`.cases`     quantities, default cases, targets
* :mod:`.backends`  curvopt, torch.func, Opacus, BackPACK, curvlinops (and the baseline)
* :mod:`.timing`    interleaved timing, profiling
* :mod:`.memory`    peak memory per case, each in a fresh process
                    (``python -m experiments.overhead.memory SPEC``)
* :mod:`.floors`    lower bounds of each quantity's extra flops and bytes, counted from the
                    problem's layers, and the sgemm/copy calibration that times them
                    (``--floors``; docs/performance.md)
* :mod:`.report`    markdown tables (with ``curvopt/BackPACK``, ``curvopt/curvlinops`` and their
                    geometric means when those are importable), JSON
* :mod:`.cli`       the command: options, case selection, printing

Each backend works on its own copy of the network (same weights, same batch). The table shows
the median over interleaved rounds of the per-round ratio to the plain step (``--spread`` adds
quartiles; JSON has them, the raw times, and how busy other processes kept the CPUs in each
round; ``--max-other-load`` drops busy rounds). ``torch.set_num_threads`` is fixed
(``--threads``, default 2) and printed. Run as a command, ``OMP_WAIT_POLICY=PASSIVE`` is set
unless the variable is set: with spinning OpenMP workers a busy machine makes 2-thread steps
erratically 5-100x slower. This package module imports nothing, so that ``__main__`` can set
the variable before torch loads.

Competitors are optional (``make reference`` installs them without replacing the CPU torch);
a backend that is not importable loses its column, and one line says why. Opacus and BackPACK
also need no install into the project's environment:
``pip install --no-deps --target DIR opacus backpack-for-pytorch`` and ``PYTHONPATH=DIR``
(their imports need neither torchvision nor their other dependencies; delete the top-level
``benchmarks``/``examples`` folders the Opacus wheel puts into DIR).
"""
