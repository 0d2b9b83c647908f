"""lslm: large-scale language-model training, implemented from scratch and measured.

The package behind the course notebooks. Each subpackage is one chapter:
``lslm.runtime`` (runtime, launch, comm ledger), ``lslm.metrics`` (memory),
``lslm.data`` (corpus, tokenizer, datasets), ``lslm.models`` (a small GPT and
Hugging Face builders), ``lslm.recipes`` (runnable workers).
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
