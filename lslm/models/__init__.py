"""Models: a small readable GPT (:mod:`lslm.models.gpt`), Hugging Face builders (:mod:`lslm.models.hf`), and
:mod:`lslm.models.deferred_init`: build on the meta device, then materialise only a rank's part with the serial
build's exact weights."""

from typing import TYPE_CHECKING, Any

from lslm.models.gpt import GPT, MLP, Block, CausalSelfAttention, GPTConfig

if TYPE_CHECKING:  # for type checkers and IDEs; at run time these load lazily below
    from lslm.models.hf import build_hf_gpt2, build_hf_llama

__all__ = ["GPT", "GPTConfig", "Block", "CausalSelfAttention", "MLP", "build_hf_gpt2", "build_hf_llama"]


def __getattr__(name: str) -> Any:
    # Lazy: importing transformers' model code takes seconds, and most chapters only need GPT.
    if name in ("build_hf_gpt2", "build_hf_llama"):
        from lslm.models import hf

        return getattr(hf, name)
    raise AttributeError(f"module 'lslm.models' has no attribute {name!r}")
