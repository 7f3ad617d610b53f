"""The time-to-result benchmark (issue 19 item 4).

* :mod:`.schedules`: learning-rate schedules of the grids;
* :mod:`.protocol`: targets, grids, one run to the targets, tuning and seeds;
* :mod:`.cost`: cost per step of the winners, interleaved in one process;
* :mod:`.report`: the JSON files, the summary and its markdown table;
* :mod:`.cli`: the commands ``ttr`` and ``ttr_cost``.
"""
