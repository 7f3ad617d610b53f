"""Reproduction of the BackPACK paper's optimizer benchmarks on DeepOBS problems, and the
time-to-result benchmark.

Layers (imports point down only; ``paper_figs`` reads result files and never imports this
package; :mod:`experiments.reproduce` is the one place that calls ``paper_figs``):

1. data and problems: :mod:`.data`, :mod:`.fetch_data`, :mod:`.problems`
2. what to train: :mod:`.optimizers` (names, presets, options), :mod:`.config` (``RunConfig``)
3. how to train: :mod:`.distributed` (torchrun), :mod:`.evaluation`, :mod:`.files`,
   :mod:`.training` (the loop of one run)
4. protocols: :mod:`.timing` (the one timed training step), :mod:`.runner` (run, grid),
   :mod:`.ttr` (time to result: protocol, interleaved cost, report),
   :mod:`.overhead` (cost of each quantity)
5. entry points: :mod:`.cli` (``python -m experiments COMMAND``, every command listed there),
   :mod:`.train_cli` (``run``, ``grid``), :mod:`.ttr.cli` (``ttr``, ``ttr_cost``),
   :mod:`.reproduce` (the main job,
   with figures); :mod:`.fetch_data`, :mod:`.overhead`, :mod:`.step_profile` and
   :mod:`.compare` define their own command next to their code

Every command is a :class:`.commands.Command` (help formatter, ``--threads``; below all layers,
it imports nothing of this package); its ``main`` is the old ``python -m experiments.X``.
"""
