"""lslm: large-scale language-model training, implemented from scratch and measured.

The package behind the course notebooks (the README's "The package" lists the same):

* ``lslm.runtime``: ``init_distributed``, the named rank grid and ``ParallelContext``,
  ``launch``, the comm ledger, rank-aware printing;
* ``lslm.collectives``: every collective from send/recv;
* ``lslm.data_parallel``: DataParallel written out, and naive / fused / bucketed / torch DDP;
* ``lslm.metrics``: memory by owner x device, model-state bytes;
* ``lslm.data``, ``lslm.models``: the shipped corpus, tokenizer and datasets pipeline; a
  small GPT and Hugging Face builders;
* ``lslm.harness``, ``lslm.recipes``, ``lslm.bench``: the recipe and bench machinery, the
  training recipes, the side-by-side benchmarks (``lslm bench``);
* ``lslm.demos``, ``lslm.exercises``, ``lslm.plot``, ``lslm.show``: what the notebooks launch,
  check, draw and show (source trimmed to the idea);
* ``lslm.integrations``: the tools used at work (torchrun scripts, Lightning, Accelerate).

``lslm.launch`` (with ``LaunchError`` and ``LaunchTimeout``) is imported lazily from
``lslm.runtime.launch``; ``lslm.cli`` is the ``lslm`` command.
"""

from typing import Any

__all__ = ["launch", "LaunchError", "LaunchTimeout"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Lazy, so that ``import lslm.data`` does not pay for the launcher's imports.
    if name in __all__:
        import importlib

        return getattr(importlib.import_module("lslm.runtime.launch"), name)
    raise AttributeError(f"module 'lslm' has no attribute {name!r}")
