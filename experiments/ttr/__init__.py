"""The time-to-result benchmark (issue 19 item 4).

* :mod:`.schedules`: learning-rate schedules of the grids;
* :mod:`.grids`: the settings (``Setting``) and the tuning grids, with their batch-size axis;
* :mod:`.cost`: cost per step of given settings, interleaved in one process;
* :mod:`.protocol`: targets, one run to the targets, tuning (per batch size by steps, across
  batch sizes in time) and seeds;
* :mod:`.report`: the JSON files, the summary and its markdown table;
* :mod:`.cli`: the commands ``ttr`` and ``ttr_cost``.

The peers (SOAP, PSGD-Kron, schedule-free AdamW) are built by :mod:`experiments.peers`.
"""
