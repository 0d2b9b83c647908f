"""Small workers the notebooks launch to show one thing each (not training recipes).

``smoke`` (a 2-process all-reduce and a deliberate failure), ``processes`` (the
torchrun environment, init methods), ``collectives_demo`` and ``data_parallel_demo``.
"""
