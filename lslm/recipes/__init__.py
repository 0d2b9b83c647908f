"""Training recipes: a validated config, a ``build(cfg, ctx)`` and the shared harness (``train``, ``ddp``)."""
