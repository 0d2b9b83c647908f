"""Training recipes on one harness (:mod:`lslm.harness`): a validated config, ``build(cfg, ctx)``, and the
harness's loop, timing, memory, results and command line (``train``: serial; ``ddp``: data parallel)."""
