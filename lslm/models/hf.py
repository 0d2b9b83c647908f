"""Hugging Face ``transformers`` models (GPT-2, Llama) built from configs, randomly initialised.

Nothing is downloaded: the configs are written here and the weights drawn from a
seed. Chapters use these to show that lslm's techniques (and PyTorch's native
ones) apply to production model code, not only to our own :class:`lslm.models.GPT`.

Token id 0 is ``<|endoftext|>`` in :func:`lslm.data.tokenizer.get_tokenizer`, so it is
used as bos/eos/pad here. Dropout is 0 by default so that runs are deterministic and
parallel runs can be compared number for number with serial ones.
"""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

__all__ = ["build_hf_gpt2", "build_hf_llama"]

#: Id of ``<|endoftext|>`` in the corpus tokenizer (special tokens come first in its vocabulary).
EOT_ID = 0
_ATTN_IMPLEMENTATIONS = ("sdpa", "eager")


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_attn(attn_implementation: str) -> None:
    if attn_implementation not in _ATTN_IMPLEMENTATIONS:
        raise ValueError(f"attn_implementation must be one of {_ATTN_IMPLEMENTATIONS}, got {attn_implementation!r}")


def _seeded_init(model_cls: type, config: object, seed: int) -> torch.nn.Module:
    # fork_rng: the weights depend on `seed` only, and the caller's global RNG stream
    # is left exactly as it was (devices=[]: never touch CUDA RNGs).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    return model


def build_hf_gpt2(
    vocab_size: int,
    n_positions: int,
    n_layer: int,
    n_head: int,
    n_embd: int,
    seed: int = 0,
    *,
    dropout: float = 0.0,
    tie_word_embeddings: bool = False,
    attn_implementation: str = "sdpa",
) -> GPT2LMHeadModel:
    """A randomly initialised ``GPT2LMHeadModel`` (same seed, same weights), on CPU, in train mode.

    With the defaults it has the same shapes and parameter count as
    ``lslm.models.GPT`` with the same sizes (untied head, biases on). Call it with
    ``model(input_ids=x, labels=x)``: Hugging Face shifts the labels internally.
    """
    _check_positive(vocab_size=vocab_size, n_positions=n_positions, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
    if n_embd % n_head:
        raise ValueError(f"n_embd={n_embd} must be divisible by n_head={n_head}")
    _check_attn(attn_implementation)
    config = GPT2Config(
        vocab_size=vocab_size, n_positions=n_positions, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
        bos_token_id=EOT_ID, eos_token_id=EOT_ID, pad_token_id=EOT_ID,
        tie_word_embeddings=tie_word_embeddings, attn_implementation=attn_implementation,
    )
    model = _seeded_init(GPT2LMHeadModel, config, seed)
    # transformers infers the loss from the class name, finds none in "GPT2LMHeadModel",
    # and warns on the first forward; name the (identical) default loss explicitly.
    model.loss_type = "ForCausalLM"
    return model.train()


def build_hf_llama(
    vocab_size: int,
    max_position_embeddings: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    hidden_size: int,
    intermediate_size: int,
    num_key_value_heads: int | None = None,
    seed: int = 0,
    *,
    tie_word_embeddings: bool = False,
    attn_implementation: str = "sdpa",
) -> LlamaForCausalLM:
    """A randomly initialised ``LlamaForCausalLM`` (RMSNorm, RoPE, SwiGLU, optional GQA).

    ``num_key_value_heads`` below ``num_attention_heads`` gives grouped-query attention;
    ``None`` means one key/value head per query head. No biases, no dropout.
    """
    _check_positive(
        vocab_size=vocab_size, max_position_embeddings=max_position_embeddings, num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads, hidden_size=hidden_size, intermediate_size=intermediate_size,
    )
    if hidden_size % num_attention_heads:
        raise ValueError(f"hidden_size={hidden_size} must be divisible by num_attention_heads={num_attention_heads}")
    kv_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
    _check_positive(num_key_value_heads=kv_heads)
    if num_attention_heads % kv_heads:
        raise ValueError(
            f"num_attention_heads={num_attention_heads} must be a multiple of num_key_value_heads={kv_heads} "
            "(each key/value head serves a whole group of query heads)"
        )
    if (hidden_size // num_attention_heads) % 2:
        raise ValueError(f"head size hidden_size/num_attention_heads must be even for rotary embeddings, "
                         f"got {hidden_size // num_attention_heads}")
    _check_attn(attn_implementation)
    config = LlamaConfig(
        vocab_size=vocab_size, max_position_embeddings=max_position_embeddings,
        num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
        num_key_value_heads=kv_heads, hidden_size=hidden_size, intermediate_size=intermediate_size,
        bos_token_id=EOT_ID, eos_token_id=EOT_ID, pad_token_id=EOT_ID, attention_dropout=0.0,
        tie_word_embeddings=tie_word_embeddings, attn_implementation=attn_implementation,
    )
    model = _seeded_init(LlamaForCausalLM, config, seed)
    return model.train()
