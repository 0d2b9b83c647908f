"""What the calculator needs to know about a model: its shape and the batch it is trained on.

Two families, the ones the course builds (:mod:`lslm.models`):

* ``"gpt"``: GPT-2-style, lslm's :class:`~lslm.models.gpt.GPT` exactly: learned position embeddings
  (``max_positions`` rows), LayerNorm (with or without bias), fused ``c_attn`` (``h -> 3h``), a GELU MLP of
  ``ffn_hidden`` (default ``4h``), a head that may be tied to the token embedding, dropout (its masks count as
  activations, Korthikanti et al. 2022).
* ``"llama"``: Llama-style: rotary positions (no parameters), RMSNorm (weight only), grouped-query attention
  (``n_kv_head`` key/value heads), a SwiGLU MLP (gate, up, down, each ``h x ffn_hidden``), no biases, no
  dropout.

The batch: ``seq_len`` tokens per sequence, ``micro_batch`` sequences per forward on one data-parallel rank,
``global_batch`` sequences per optimizer step over all of them (so ``global_batch / (dp · micro_batch)``
micro-batches are accumulated per step). :func:`model_presets` gives the models the course sizes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

__all__ = ["ARCHES", "KERNEL_STYLES", "LOSS_STYLES", "ModelSpec", "model_presets"]

ARCHES = ("gpt", "llama")
#: how the training step runs the loss, which sets its temporaries (:func:`lslm.plan.activations.loss_bytes_per_logit`)
LOSS_STYLES = ("lslm", "torchtitan", "megatron")
#: how the layers' elementwise work runs, which sets its memory traffic (:mod:`lslm.plan.calibrated`)
KERNEL_STYLES = ("fused", "torchtitan")


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"ModelSpec.{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer and its training batch (module doc); checked on construction."""

    n_layer: int
    hidden: int
    n_head: int
    vocab: int
    seq_len: int
    micro_batch: int = 1
    global_batch: int = 1
    n_kv_head: int | None = None  #: None: as many as ``n_head`` (multi-head attention)
    ffn_hidden: int | None = None  #: None: ``4 * hidden`` (GPT); required for "llama"
    tied: bool = False  #: the head shares the token embedding's weight
    arch: str = "gpt"
    bias: bool = True  #: "gpt" only: linear and LayerNorm biases
    max_positions: int | None = None  #: "gpt" only: rows of the position embedding (None: ``seq_len``)
    dropout: bool = True  #: dropout masks are saved for backward (Korthikanti's accounting); "llama": none
    name: str = "custom"
    #: the training step's loss, one of :data:`LOSS_STYLES`: "lslm" (the caller keeps the logits through the
    #: backward), "torchtitan" (``del pred`` before ``loss.backward()``), "megatron" (Megatron-LM's vocabulary-
    #: parallel loss, worked in place on the fp32 copy); see lslm.plan.activations, "The loss"
    loss: str = "lslm"
    #: the layers' elementwise work, one of :data:`KERNEL_STYLES`: "fused" (one pass per norm, activation and
    #: residual: lslm's GPT's kernels, Megatron-LM's fused ones), "torchtitan" (torchtitan's eager Llama block, op
    #: by op: RMSNorm in fp32, rotary embeddings as complex products; "llama" only); see lslm.plan.calibrated
    kernels: str = "fused"

    def __post_init__(self) -> None:
        for field in ("n_layer", "hidden", "n_head", "vocab", "seq_len", "micro_batch", "global_batch"):
            _positive(field, getattr(self, field))
        if self.arch not in ARCHES:
            raise ValueError(f"ModelSpec.arch must be one of {ARCHES}, got {self.arch!r}")
        if self.loss not in LOSS_STYLES:
            raise ValueError(f"ModelSpec.loss must be one of {LOSS_STYLES}, got {self.loss!r}")
        if self.kernels not in KERNEL_STYLES:
            raise ValueError(f"ModelSpec.kernels must be one of {KERNEL_STYLES}, got {self.kernels!r}")
        if self.kernels == "torchtitan" and self.arch != "llama":
            raise ValueError("ModelSpec.kernels='torchtitan' counts torchtitan's eager Llama block: it needs "
                             "arch='llama'")
        if self.hidden % self.n_head:
            raise ValueError(f"hidden={self.hidden} must be divisible by n_head={self.n_head} (head width)")
        if self.n_kv_head is not None:
            _positive("n_kv_head", self.n_kv_head)
            if self.n_head % self.n_kv_head:
                raise ValueError(f"n_head={self.n_head} must be a multiple of n_kv_head={self.n_kv_head} "
                                 "(each key/value head serves n_head/n_kv_head query heads)")
        if self.ffn_hidden is not None:
            _positive("ffn_hidden", self.ffn_hidden)
        elif self.arch == "llama":
            raise ValueError("a llama model needs ffn_hidden (e.g. 14336 for Llama-3 8B): its SwiGLU width is not "
                             "a fixed multiple of hidden")
        if self.max_positions is not None:
            _positive("max_positions", self.max_positions)
            if self.max_positions < self.seq_len:
                raise ValueError(f"seq_len={self.seq_len} exceeds max_positions={self.max_positions}")
        if self.global_batch % self.micro_batch:
            raise ValueError(f"global_batch={self.global_batch} must be a multiple of micro_batch={self.micro_batch}")

    @property
    def kv_heads(self) -> int:
        """Key/value heads (``n_head`` without grouped-query attention)."""
        return self.n_kv_head or self.n_head

    @property
    def head_dim(self) -> int:
        """Width of one head, ``hidden / n_head``."""
        return self.hidden // self.n_head

    @property
    def ffn(self) -> int:
        """The MLP's inner width."""
        return self.ffn_hidden or 4 * self.hidden

    @property
    def positions(self) -> int:
        """Rows of the learned position embedding ("gpt"; 0 for "llama", whose rotary positions have none)."""
        return (self.max_positions or self.seq_len) if self.arch == "gpt" else 0

    def with_batch(self, micro_batch: int | None = None, global_batch: int | None = None) -> ModelSpec:
        """The same model with another batch (the search varies the micro-batch)."""
        return replace(self, micro_batch=micro_batch or self.micro_batch,
                       global_batch=global_batch or self.global_batch)

    @classmethod
    def from_gpt_config(cls, config: Any, *, seq_len: int | None = None, micro_batch: int = 1,
                        global_batch: int | None = None) -> ModelSpec:
        """The spec of lslm's :class:`~lslm.models.gpt.GPT` built from ``config`` (a ``GPTConfig``).

        ``seq_len`` defaults to the config's ``block_size``; dropout masks count when ``config.dropout > 0``.
        A GPT with grouped-query attention (``n_kv_head < n_head``) is refused: the ``gpt`` architecture's counts
        are multi-head attention's.
        """
        kv = getattr(config, "kv_heads", config.n_head)
        if kv != config.n_head:
            raise ValueError(f"the calculator counts lslm's GPT with multi-head attention; this config has n_kv_head = "
                             f"{kv} < n_head = {config.n_head}: build the spec by hand (ModelSpec(..., n_kv_head=...)) "
                             "knowing that the 'gpt' architecture's c_attn and activation counts assume 3 x n_embd")
        return cls(n_layer=config.n_layer, hidden=config.n_embd, n_head=config.n_head, vocab=config.vocab_size,
                   seq_len=seq_len or config.block_size, micro_batch=micro_batch,
                   global_batch=global_batch or micro_batch, tied=config.tie_weights, arch="gpt",
                   bias=config.bias, max_positions=config.block_size, dropout=config.dropout > 0, name="lslm GPT")


def model_presets() -> dict[str, ModelSpec]:
    """Published configurations (shapes from the papers / model cards cited; batches as noted).

    * ``gpt2-small``: Radford et al. 2019 (12 x 768, 12 heads, vocabulary 50,257, context 1024, tied head, batch
      512 sequences; the micro-batch of 8 is ours).
    * ``gpt3-175b``: Brown et al. 2020, Table 2.1 (96 x 12288, 96 heads, context 2048; batch 3.2M tokens =
      1536 sequences); vocabulary 50,257 (GPT-2's BPE); the head assumed tied as in GPT-2 (the
      paper does not say).
    * ``llama2-70b``: Touvron et al. 2023 (80 x 8192, 64 heads, 8 KV heads, FFN 28672, vocabulary 32,000,
      context 4096, batch 4M tokens = 1024 sequences; untied head).
    * ``llama3-8b``: Llama 3 (32 x 4096, 32 heads, 8 KV heads, FFN 14336, vocabulary 128,256, context 8192,
      untied head); the batch, 512 sequences (4M tokens), is our assumption.
    """
    return {
        "gpt2-small": ModelSpec(12, 768, 12, 50257, 1024, micro_batch=8, global_batch=512, tied=True,
                                name="GPT-2 small"),
        "gpt3-175b": ModelSpec(96, 12288, 96, 50257, 2048, micro_batch=1, global_batch=1536, tied=True,
                               name="GPT-3 175B"),
        "llama2-70b": ModelSpec(80, 8192, 64, 32000, 4096, micro_batch=1, global_batch=1024, n_kv_head=8,
                                ffn_hidden=28672, arch="llama", dropout=False, name="Llama-2 70B"),
        "llama3-8b": ModelSpec(32, 4096, 32, 128256, 8192, micro_batch=1, global_batch=512, n_kv_head=8,
                               ffn_hidden=14336, arch="llama", dropout=False, name="Llama-3 8B"),
    }
