"""lslm: large-scale language-model training, implemented from scratch and measured.

The package behind the course notebooks (the README's "The package" lists the same), in its layers, lowest first
(a package imports only from the layers below it; ``make lint`` checks it, docs/architecture.md draws it):

1. ``lslm.runtime`` (``init_distributed``, the named rank grid and ``ParallelContext``, the comm ledger, rank-aware
   printing, atomic file writes) and ``lslm.show`` (source listings trimmed to the idea);
2. ``lslm.launcher`` (``launch`` a torchrun job from a notebook, clear errors, no orphans), ``lslm.models`` (a small
   GPT, Hugging Face builders), ``lslm.data`` (the shipped corpus, tokenizer, datasets pipeline, samplers);
3. ``lslm.metrics``: memory by owner x device, model-state bytes, activation and step-time models, the collectives'
   cost model;
4. ``lslm.collectives`` (every collective from send/recv), ``lslm.data_parallel`` (DataParallel written out;
   naive / fused / bucketed / torch DDP; gradient accumulation), ``lslm.harness`` (what recipes and benches share);
5. ``lslm.precision`` (loss scaling, master weights, fp16 / bf16), ``lslm.tensor_parallel`` (Megatron-style layers
   and ``apply_tensor_parallel``), ``lslm.pipeline`` (schedules, executor, simulator, 2BW);
6. ``lslm.recipes`` (training recipes on the harness), ``lslm.plot`` (the figures);
7. ``lslm.integrations`` (torchrun scripts, Lightning, Accelerate, DeepSpeed's ZeRO engine);
8. ``lslm.bench`` (side-by-side benchmarks, ``lslm bench``), ``lslm.demos`` (what the notebooks launch),
   ``lslm.exercises`` (checkers, hints, solutions);
9. ``lslm.cli``: the ``lslm`` command.

``lslm.launch``, ``lslm.LaunchError``, ``lslm.LaunchTimeout`` and ``lslm.LaunchResults`` are
:mod:`lslm.launcher`'s, imported on first use.
"""

from typing import Any

__all__ = ["launch", "LaunchError", "LaunchResults", "LaunchTimeout"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Lazy, so that ``import lslm.data`` does not pay for the launcher's imports.
    if name in __all__:
        import importlib

        return getattr(importlib.import_module("lslm.launcher"), name)
    raise AttributeError(f"module 'lslm' has no attribute {name!r}")
