"""Data parallelism: single-process DataParallel and DistributedDataParallel from scratch.

``single_process``: the nn.DataParallel algorithm written out (scatter, replicate,
parallel_apply, gather) with its two classic problems measured. ``ddp``: three
multi-process gradient synchronisations (naive, fused, bucketed with overlap)
behind one API, plus torch's DistributedDataParallel behind the same API.
``onebit_compress`` / ``onebit_adam`` / ``onebit_run``: 1-bit Adam (Tang et al. 2021),
the compressed all-reduce with error feedback and the optimizer that owns its communication.
"""
